"""The run report, the comparison page and the sweep index, on run dirs written by hand (no
training): a healthy run, one with planted findings of every severity and rules that fire, and a
crashed one (crash.json, no metrics.json, a history line cut mid-write). Plus the CLI and a real
headless browser rendering the page."""

from __future__ import annotations

import io
import json
import math
import os
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

from tests.helpers.runs import REPO

VOID = {"meta", "img", "br", "hr", "link", "input"}
FIGURES = ("loss", "grad_norms", "rank_step_time", "rank_memory", "moe_load", "moe_router", "comm_compute")
PLANTED = [  # (severity, check, code, message) -- messages carry markup that must be escaped
    ("error", "grad_monitor", "nonfinite_grad", "NaN in grad of <model.layers.2.mlp> & friends at step 7"),
    ("warning", "log_sync", "straggler", "rank 1 is 2.3x slower than rank 0 (\"step_time\")"),
    ("info", "reproducibility", "seeded", "seed 42 <script>alert(1)</script>"),
]
CRASH_ERROR = "RuntimeError: Watchdog caught collective operation timeout: WorkGloo(OpType=ALLREDUCE)"


class Page(HTMLParser):
    """Tags, text and nesting errors of an HTML page."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.stack, self.errors, self.tags, self.images, self.text = [], [], [], [], []
        self.row_classes: list[tuple[str, list[str]]] = []
        self.feed(text)
        self.close()

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.append(tag)
        if tag == "img":
            self.images.append(attrs.get("src", ""))
        if tag == "tr":
            self.row_classes.append((attrs.get("class") or "", []))
        if tag not in VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        if tag in VOID:
            return
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1:] or 'nothing'}")
            return
        self.stack.pop()

    def handle_data(self, data):
        self.text.append(data)
        if self.row_classes and "tr" in self.stack:
            self.row_classes[-1][1].append(data)

    @property
    def all_text(self) -> str:
        return "".join(self.text)


def parse(html_path: Path) -> Page:
    page = Page(html_path.read_text())
    assert not page.errors and not page.stack, (page.errors, page.stack)
    assert "script" not in page.tags, "text reached the page unescaped"
    assert not any(t in page.tags for t in ("link",)) and "http" not in " ".join(page.images)
    return page


def decode_png(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        img.load()  # decodes every pixel: a truncated PNG raises here
        return img.size


def data_uri_pngs(page: Page) -> list[tuple[int, int]]:
    import base64

    sizes = []
    for src in page.images:
        assert src.startswith("data:image/png;base64,"), src[:60]
        sizes.append(decode_png(base64.b64decode(src.split(",", 1)[1], validate=True)))
    return sizes


# ---------- synthetic run dirs ---------------------------------------------------------------
def write_run(run_dir: Path, loss: list[float], findings=(), metrics: dict | None = None, crash: dict | None = None,
              debug: bool = True, world: int = 2, env_mismatch: bool = False, overrides=("trainer=ddp_sim",)) -> Path:
    from dsdebug.report.history import HistoryLogger

    run_dir.mkdir(parents=True)
    logger = HistoryLogger(run_dir)
    for step, value in enumerate(loss):
        row = {"train/loss": value, "lr-AdamW/pg1": 1e-3 * min(1.0, (step + 1) / 4), "moe/load_imbalance": 1.2}
        if step % 5 == 4:
            row["val/loss"] = value + 0.1
        if debug:
            row |= {f"grad/norm/model.layers.{i}": 0.5 + 0.1 * i + 0.01 * step for i in range(3)}
            row |= {"grad/norm/global": 1.0, "comm/share": 0.2}
            if step % 10 == 9:  # moe_router's windows
                row |= {f"moe_router/load_entropy/L{i}": 0.9 + 0.01 * i for i in (1, 3)}
            for stat, base in (("step_time", 0.1), ("mem_mb", 900.0), ("comm_time", 0.02), ("compute_time", 0.08)):
                row |= {f"ranks/{stat}_min": base, f"ranks/{stat}_mean": base * 1.1, f"ranks/{stat}_max": base * 1.3,
                        f"ranks/{stat}_max_rank": 1, f"ranks/{stat}_min_rank": 0}
        logger.log_metrics(row, step=step)
    (run_dir / ".hydra").mkdir()
    (run_dir / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    (run_dir / "config_resolved.yaml").write_text(
        "seed: 42\ntrainer:\n  max_steps: %d\n  devices: %d\n  precision: 32-true\n"
        "optim:\n  lr: 0.001\n  scheduler:\n    warmup_ratio: 0.1\n" % (len(loss), world))
    with open(run_dir / "findings.jsonl", "w") as f:
        for severity, check, code, message in findings:
            f.write(json.dumps({"time": 0, "step": 7, "rank": 1, "check": check, "severity": severity, "code": code,
                                "message": message, "advice": f"advice for {code}", "details": {}}) + "\n")
        if debug:  # moe_router's end-of-run share matrix (its heatmap)
            f.write(json.dumps({"time": 0, "step": len(loss) - 1, "rank": None, "check": "moe_router",
                                "severity": "info", "code": "router_summary", "message": "2 MoE layers",
                                "details": {"steps": [0, len(loss) - 1], "share": {
                                    "L1": [0.3, 0.2, 0.25, 0.25], "L3": [0.0, 0.4, 0.3, 0.3]}}}) + "\n")
    if metrics is not None:
        (run_dir / "metrics.json").write_text(json.dumps(metrics))
    if crash is not None:
        (run_dir / "crash.json").write_text(json.dumps(crash))
    if debug:
        (run_dir / "repro").mkdir()
        for rank in range(world):
            hash_seed = str(rank + 1) if env_mismatch else "0"
            (run_dir / "repro" / f"rank{rank}.json").write_text(json.dumps(
                {"rank": rank, "world_size": world, "seed": 42, "env": {"PYTHONHASHSEED": hash_seed},
                 "versions": {"torch": "2.13.0"}, "rng_state_file": f"rng_state_rank{rank}.pt"}))
        (run_dir / "profiler").mkdir()
        (run_dir / "profiler" / "top_ops_rank0.json").write_text(json.dumps(
            {"sort_by": "self_cpu_time_total", "rows": [
                {"name": "aten::mm", "calls": 40, "self_cpu_us": 5123.0},
                {"name": "aten::<weird>&op", "calls": 3, "self_cpu_us": 17.5}]}))
    return run_dir


def healthy_loss(n: int = 40) -> list[float]:
    return [5.0 * math.exp(-s / 12) + 3.0 + 0.01 * math.sin(s) for s in range(n)]


def make_healthy(path: Path) -> Path:
    loss = healthy_loss()
    return write_run(path, loss, metrics={"global_step": 40, "status": "completed", "time_s": 12.5, "world_size": 2,
                                          "strategy": "DebugDeepSpeedStrategy", "zero_stage": 2,
                                          "train/loss": loss[-1], "precision": "32-true"})


def make_planted(path: Path) -> Path:
    # falls, then blows up: the advisor's loss_diverging (error) fires on top of the planted findings
    loss = healthy_loss(20) + [3.5 * 1.15 ** i for i in range(20)]
    return write_run(path, loss, findings=PLANTED, env_mismatch=True,
                     metrics={"global_step": 40, "status": "completed", "time_s": 9.0, "world_size": 2})


def make_crashed(path: Path) -> Path:
    run = write_run(path, healthy_loss(12), debug=False, overrides=("trainer=ddp_sim", "debug=comm"),
                    crash={"status": "crashed", "exit_code": 1, "error": CRASH_ERROR, "exception": "RuntimeError",
                           "traceback_tail": "File \"train.py\", line 3\n  fit()\nRuntimeError: timeout"})
    with open(run / "history.jsonl", "a") as f:
        f.write('{"step": 12, "train/lo')  # the crash cut this line
    with open(run / "findings.jsonl", "a") as f:
        f.write('{"check": "comm_debug", "sev')
    return run


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runs")
    return {"healthy": make_healthy(root / "healthy"), "planted": make_planted(root / "planted"),
            "crashed": make_crashed(root / "crashed")}


# ---------- the report ----------------------------------------------------------------------
def test_healthy_report_has_every_figure_and_section(runs):
    from dsdebug.report.render import write_report

    html_path, md_path = write_report(runs["healthy"])
    page = parse(html_path)
    sizes = data_uri_pngs(page)
    assert len(sizes) == len(FIGURES) and all(w > 300 and h > 150 for w, h in sizes), sizes
    text = page.all_text
    assert "not recorded" not in text and "could not" not in text, text
    assert "python train.py trainer=ddp_sim" in text and "DebugDeepSpeedStrategy (ZeRO stage 2)" in text
    assert "aten::<weird>&op" in text  # profiler table, escaped and back
    assert "identical on every rank" in text
    assert "<details>" in html_path.read_text() and "warmup_ratio: 0.1" in text
    md = md_path.read_text()
    for name in FIGURES:  # markdown refers to real PNG files beside it
        assert f"](report_files/{name}.png)" in md
        decode_png((md_path.parent / "report_files" / f"{name}.png").read_bytes())


def test_planted_findings_grouped_by_severity_and_escaped(runs):
    from dsdebug.report.render import write_report

    html_path, md_path = write_report(runs["planted"])
    page = parse(html_path)
    data_uri_pngs(page)
    text, md = page.all_text, md_path.read_text()
    for severity, check, code, message in PLANTED:
        assert message in text and f"{check}/{code}" in text and f"advice for {code}" in text
        assert message.replace("|", "\\|") in md
    assert "advisor/loss_diverging" in text  # rules.evaluate(run) adds its findings
    # error group first, then warning, then info; the advisor's error sits with the errors
    order = [text.index(f"{s} (") for s in ("error", "warning", "info")]
    assert order == sorted(order), order
    assert text.index("advisor/loss_diverging") < order[1]
    mismatched = [cells for cls, cells in page.row_classes if cls == "mismatch"]
    assert any("env.PYTHONHASHSEED" in "".join(cells) for cells in mismatched), page.row_classes
    assert "differ in: env.PYTHONHASHSEED" in text


def test_crashed_run_report_names_the_error(runs):
    from dsdebug.report.render import write_report

    html_path, md_path = write_report(runs["crashed"])
    page = parse(html_path)
    sizes = data_uri_pngs(page)
    text = page.all_text
    assert CRASH_ERROR in text and CRASH_ERROR in md_path.read_text()
    assert "crashed" in text and "11 (last logged; no metrics.json)" in text
    assert "advisor/nccl_timeout" in text  # the rule reads crash.json
    assert "not recorded: enable debug=grads" in text and "not recorded: enable debug=repro" in text
    assert "could not be built" not in text
    assert len(sizes) == 2  # loss and MoE load from the truncated history; no debug figures


def test_report_survives_an_empty_or_garbled_run_dir(tmp_path):
    from dsdebug.report.render import write_report

    (tmp_path / "metrics.json").write_text("[1, 2")
    (tmp_path / "config_resolved.yaml").write_text("trainer: [unclosed\n")
    (tmp_path / "crash.json").write_text('"just a string"')
    (tmp_path / "history.jsonl").write_text('[1]\n{"step": 0, "train/loss": "nan"}\n')
    (tmp_path / "profiler").mkdir()
    (tmp_path / "profiler" / "top_ops_rank0.json").write_text('{"rows": "oops"}')
    html_path, _ = write_report(tmp_path)
    text = parse(html_path).all_text
    assert "Run summary" in text and "Resolved config" in text and "not recorded" in text


# ---------- compare and sweep index ---------------------------------------------------------
def test_compare_two_runs(runs, tmp_path):
    from dsdebug.report.compare import compare, first_loss_difference
    from dsdebug.report.load import load_run

    a, b = load_run(runs["healthy"]), load_run(runs["planted"])
    assert first_loss_difference(a, b)["step"] == 20  # the planted loss leaves the healthy one at step 20
    assert first_loss_difference(a, a) == {"step": None, "common": 40}
    html_path, md_path = compare(runs["healthy"], runs["planted"], tmp_path / "cmp")
    page = parse(html_path)
    assert len(data_uri_pngs(page)) == 1
    text = page.all_text
    assert "train/loss first differs at step 20" in text
    assert "trainer.max_steps" not in text  # same value in both: not a difference
    env_rows = [cells for cls, cells in page.row_classes if cls == "mismatch" and cells[0] == "env.PYTHONHASHSEED"]
    assert env_rows and env_rows[0][1:] == ["0", "1"], page.row_classes  # rank 0's records differ
    for _, check, code, _ in PLANTED:
        assert f"{check}/{code}" in text
    assert (tmp_path / "cmp" / "compare_files" / "loss_overlay.png").is_file() and md_path.is_file()


def make_sweep(root: Path) -> Path:
    sweep = root / "multiruns" / "2026-01-01_00-00-00"
    make_healthy(sweep / "0")
    make_crashed(sweep / "1")
    rows = [{"job": 0, "overrides": ["optim.lr=1e-3", "trainer.max_steps=40"], "returncode": 0,
             "status": "completed", "metric": "val/loss", "value": 3.2, "dir": str(sweep / "0")},
            {"job": 1, "overrides": ["optim.lr=3e-1", "trainer.max_steps=40"], "returncode": 1, "status": "failed",
             "metric": "val/loss", "value": None, "dir": str(sweep / "1")}]
    (sweep / "sweep_summary.json").write_text(json.dumps(rows))
    (sweep / "multirun.yaml").write_text("hydra: {}\n")
    return sweep


def test_sweep_index(tmp_path):
    from dsdebug.report.sweep import build, sweep_index

    sweep = make_sweep(tmp_path)
    _, rows = build(sweep)
    assert [r["status"].split(":")[0] for r in rows] == ["completed", "failed"]
    assert rows[0]["train_loss"] == pytest.approx(healthy_loss()[-1]) and rows[1]["val_loss"] is not None
    html_path, _ = sweep_index(sweep)
    page = parse(html_path)
    assert len(data_uri_pngs(page)) == 1
    text = page.all_text
    assert "common overrides: trainer.max_steps=40" in text and "optim.lr=3e-1" in text
    assert CRASH_ERROR in text and "1 completed" in text
    failed = [cells for cls, cells in page.row_classes if cls == "mismatch"]
    assert len(failed) == 1 and failed[0][0] == "1"


# ---------- the CLI -------------------------------------------------------------------------
def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dsdebug.report", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})


def test_cli_regenerates_compares_indexes_and_rejects_bad_paths(runs, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(runs["planted"], run)
    for name in ("report.html", "report.md"):
        (run / name).unlink(missing_ok=True)
    proc = cli(str(run))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(run / "report.html"), str(run / "report.md")]
    assert PLANTED[0][3] in parse(run / "report.html").all_text

    proc = cli(str(run), str(runs["healthy"]))
    assert proc.returncode == 0, proc.stderr
    assert "first differs at step 20" in parse(run / "compare_healthy" / "compare.html").all_text

    sweep = make_sweep(tmp_path / "s")
    proc = cli(str(sweep))
    assert proc.returncode == 0, proc.stderr
    assert (sweep / "sweep_index.html").is_file() and (sweep / "sweep_index_files" / "final_loss.png").is_file()

    empty = tmp_path / "empty"
    empty.mkdir()
    for args, names in (([str(tmp_path / "nope")], "does not exist"), ([str(empty)], "neither a run dir"),
                        ([str(run / "metrics.json")], "not a directory"), ([str(run), str(empty)], "RUN_B")):
        proc = cli(*args)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (args, proc.stderr)
        assert names in lines[0] and "valid" in lines[0] and "Traceback" not in proc.stderr
    assert (run / "report.html").is_file()  # nothing already written was lost


# ---------- a real browser ------------------------------------------------------------------
def _chromium() -> str | None:
    """A headless-capable browser on PATH. Tests install nothing: .ci/run installs chromium before
    ``make test-all`` where it can (root, apt-get); elsewhere the test is skipped, saying so."""
    return next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)


def test_report_renders_in_headless_chromium(runs, tmp_path):
    from dsdebug.report.render import write_report

    browser = _chromium()
    if browser is None:
        pytest.skip("no chromium, chromium-browser or google-chrome on PATH (install one, e.g. "
                    "`apt-get install -y chromium`; .ci/run does it before make test-all)")
    html_path, _ = write_report(runs["planted"])
    shot = tmp_path / "shot.png"
    proc = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           f"--screenshot={shot}", "--window-size=1200,2000", html_path.resolve().as_uri()],
                          capture_output=True, text=True, timeout=120)
    assert shot.is_file(), proc.stderr[-2000:]
    from PIL import Image, ImageStat

    with Image.open(shot) as img:
        gray = img.convert("L")
        assert gray.size == (1200, 2000)
        assert ImageStat.Stat(gray).var[0] > 200  # text, tables and figures, not a blank page
        import numpy as np

        rgb = np.asarray(img.convert("RGB")).astype(int)
        colourful = float(((rgb.max(axis=2) - rgb.min(axis=2)) > 80).mean())
        # the figures drew (a text-only page: ~0.3% colourful pixels, headings and row markers)
        assert colourful > 0.01, colourful


def test_deepspeed_wall_clock_timers_draw_the_phase_figure(tmp_path):
    """A ds_config with wall_clock_breakdown logs deepspeed/<phase>_ms (ds_wall_clock): with no
    debug preset on, the report's comm/compute figure stacks those phases."""
    from dsdebug.report.load import load_run
    from dsdebug.report.plots import comm_compute

    rows = [{"step": s, "deepspeed/fwd_ms": 200.0 + s, "deepspeed/bwd_inner_ms": 280.0, "deepspeed/bwd_allreduce_ms":
             30.0, "deepspeed/step_ms": 25.0} for s in (1, 2, 3)]
    (tmp_path / "history.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    png = comm_compute(load_run(tmp_path))
    assert png is not None and png.startswith(b"\x89PNG")
    (tmp_path / "history.jsonl").write_text(json.dumps({"step": 1, "train/loss": 8.0}) + "\n")
    assert comm_compute(load_run(tmp_path)) is None
