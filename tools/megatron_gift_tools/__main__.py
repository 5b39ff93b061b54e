"""`python -m megatron_gift_tools` runs the command-line interface."""

from megatron_gift_tools.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
