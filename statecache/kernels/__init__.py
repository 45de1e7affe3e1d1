"""Token-mixing kernels: the torch reference and the CUDA set (our Triton kernels, FlashAttention, fla's on demand;
dispatch picks between them), the Triton kernels themselves (span, gdn, conv, norm) and compiled elementwise pieces
(fuse). Knows nothing of the model's layers, rows or the cache."""
