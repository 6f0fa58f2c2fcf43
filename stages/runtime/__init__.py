"""What the other stages run on: device and precision policy, torchrun/FSDP2 launching, the Ray cluster and Ray
training, trainer checkpoints, lazy imports and code digests, and the cache-key field declarations."""
