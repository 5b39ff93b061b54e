"""`python -m megatron_gift` runs the command-line interface."""

from megatron_gift.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
