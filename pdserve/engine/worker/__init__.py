"""Every tensor-parallel rank: the executors, the rank worker, the model runner (with the
step's staging), CUDA graphs, the sampler and penalties, the device choice, and each rank's
KV storage.  Nothing here imports ``engine/core``."""
