"""The Megatron-Core adapter: the only layer of megatron-gift that imports Megatron."""
