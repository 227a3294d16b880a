"""Entry point: imports every command module (each registers itself on the app) and runs it."""

from __future__ import annotations

import importlib
import sys

from cemtool.cli.app import app

COMMAND_MODULES = ["cemtool.cli.train_cmd", "cemtool.cli.info_cmd", "cemtool.cli.sharpness_cmd",
                   "cemtool.cli.collapse_cmd", "cemtool.cli.saturation_cmd", "cemtool.cli.forgetting_cmd",
                   "cemtool.cli.sweep_cmd", "cemtool.cli.compare_cmd", "cemtool.cli.plot_cmd", "cemtool.cli.demo_cmd",
                   "cemtool.cli.export_cmd", "cemtool.cli.sample_cmd"]

for _mod in COMMAND_MODULES:
    importlib.import_module(_mod)


def main() -> None:
    try:
        app()
    except SystemExit as e:  # every command ends here (typer exits with the command's status)
        if "torch.distributed" in sys.modules:  # only a command that imported torch can have joined a process group
            from cemtool.distributed import exit_process  # start-up: torch

            exit_process(e.code)  # under torchrun: leaves at once (see there); otherwise returns
        raise


__all__ = ["app", "main"]
