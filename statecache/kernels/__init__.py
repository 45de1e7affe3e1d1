"""Token-mixing kernels: the torch reference, fla and FlashAttention, and our Triton kernels (dispatch picks among
them), the Triton kernels themselves (span, gdn, conv, norm) and compiled elementwise pieces (fuse). Knows nothing of
the model's layers, rows or the cache."""
