"""megatron-gift: FP8 data-parallel gradient communication for Megatron-Core, with GIFT whitening."""

__version__ = "0.1.0"
