"""`torchrun --nproc-per-node N+1 -m charioteer.pipeline <charioteer command> --pipeline-parallel-size N ...`

Every rank runs this module: rank 0 runs the `charioteer` command (the driver: engine, scheduler,
sampling), ranks 1..N run pipeline stages, which get their setup from the driver and load the
model themselves. Works with any launcher that sets MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE.
"""
import os
import sys


def main() -> int:
    if int(os.environ.get("RANK", "0")) == 0:
        from charioteer.cli import main as cli_main

        return cli_main(sys.argv[1:])
    from charioteer.pipeline.stage import main as stage_main

    stage_main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
