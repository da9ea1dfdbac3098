"""The ``error:`` line a bad command line gets, found in this process (tests/config/test_bad_input.py
runs one real ``train.py`` per layer and compares its line with this one)."""

from __future__ import annotations

import os
from pathlib import Path

from tests.helpers.runs import CONF, compose_as_hydra_main


def cli_error_lines(args: list[str], log_dir: Path, cache: Path, capsys) -> list[str]:
    """The ``error:`` lines ``python train.py <args> paths.log_dir=<log_dir>`` prints, from the layers of
    the command line called in this process in its order (src/train.py ``main``, trainer/cli.py ``run``,
    trainer/entry.py ``train``): composition (``precheck_overrides``), Hydra's run-start callback
    (``OutputDirCheck``), the composed config (``prepare``), the checkpoint to resume (``resolve_ckpt_path``,
    ``plan_resume``), building (``build``), the checkpoint's config (``check_resume_config``) and data
    preparation (the datamodule's ``setup``, which Lightning calls inside fit). Fails if no layer refuses;
    an exception behind which there is no ConfigError is raised (the command line: a traceback)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    from dsdebug.checkpoint.checkpoints import resolve_ckpt_path
    from dsdebug.checkpoint.reshard import plan_resume
    from dsdebug.checkpoint.resume import check_resume_config
    from dsdebug.config.prepare import prepare
    from dsdebug.config.validate import OutputDirCheck
    from dsdebug.findings import configure_channel
    from dsdebug.trainer.cli import find_config_error, precheck_overrides
    from dsdebug.trainer.entry import build, resolved_config

    argv = [*args, f"paths.log_dir={log_dir}"]
    multirun = "-m" in argv
    env = dict(os.environ)  # prepare and the callbacks built set env vars: put back afterwards
    overrides = [a for a in argv if a != "-m"]
    try:
        precheck_overrides(argv, CONF, "train")
        # a sweep's own dir check sees the sweep; its jobs are runs of their own (one is enough here)
        parsed = OverridesParser.create().parse_overrides(overrides)
        one_job = [o.input_line for o in parsed if not o.is_sweep_override()]
        GlobalHydra.instance().clear()
        with initialize_config_dir(str(CONF), version_base="1.3"):
            hydra_cfg = compose("train", overrides=one_job, return_hydra_config=True)
        GlobalHydra.instance().clear()
        check = OutputDirCheck()  # conf/hydra/default.yaml: before Hydra creates the run dir
        (check.on_multirun_start if multirun else check.on_run_start)(config=hydra_cfg)
        run_dir = Path(OmegaConf.select(hydra_cfg, "hydra.run.dir"))
        plan = prepare(compose_as_hydra_main(one_job, run_dir, cache))
        cfg = plan.cfg
        output_dir = Path(cfg.paths.output_dir)
        configure_channel(output_dir)
        chosen = resolve_ckpt_path(cfg, output_dir)
        plan_resume(cfg, chosen, output_dir, plan.world_size)
        built = build(plan)
        check_resume_config(resolved_config(built.plan), chosen)  # as trainer/entry.py _train
        datamodule = built.datamodule
        datamodule.setup("fit")
    except SystemExit as e:  # dsdebug.errors.fail: the line is printed, then exit
        assert e.code == 2, e.code
        return [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    except Exception as e:  # noqa: BLE001 - what trainer/cli.py run classifies as bad input
        error = find_config_error(e)
        if error is None:
            raise
        return [f"error: {error}"]
    finally:
        GlobalHydra.instance().clear()
        HydraConfig.instance().cfg = None
        if dict(os.environ) != env:
            os.environ.clear()
            os.environ.update(env)
    raise AssertionError(f"no layer refused train.py {' '.join(argv)}")


def assert_one_line_error(lines: list[str], must_contain: list[str]) -> None:
    """Exactly one ``error:`` line, and it contains every text of ``must_contain``."""
    assert len(lines) == 1, lines
    for text in must_contain:
        assert text in lines[0], (text, lines[0])
