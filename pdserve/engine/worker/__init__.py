"""Every tensor-parallel rank: the executors, the rank worker, the model runner, staging,
CUDA graphs, the sampler and penalties.  Nothing here imports ``engine/core``."""
