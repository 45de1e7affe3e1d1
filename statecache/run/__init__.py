"""Running the model: the batched runner that runs a step's pieces as one packed forward (batch), its CUDA graphs
(graphs), what image rows hand the forward (images) and the persistent compile caches (compile_cache). Only this
package and the model and kernels under it touch CUDA. Knows nothing of scheduling or of which states the cache
keeps."""
