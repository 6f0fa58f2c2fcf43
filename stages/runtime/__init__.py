"""What the other stages run on: device and precision policy, torchrun/FSDP2 launching, the Ray cluster and Ray
training, trainer checkpoints, loading a policy (base model + LoRA adapter), bearer tokens of posttrain's HTTP
servers, lazy imports and code digests, and the cache-key field declarations."""
