"""Consistency across ranks and node-local run dirs, without processes: the comparison (incl. redaction),
the facts, the merge of a node-local rank's findings and files, the report's rank list, the log format."""

from __future__ import annotations

import json
import logging
import socket

import pytest
import torch
from omegaconf import OmegaConf

from dsdebug.errors import ConfigError
from dsdebug.findings.ranks import name_ranks, rank_ranges
from dsdebug.callbacks.consistency import ConsistencyCheck, compare_facts, env_facts, rank_facts
from dsdebug.config.fingerprint import config_facts
from dsdebug.distributed.log_format import HostFormatter
from dsdebug.distributed.rank_files import merge_payloads, rank_payload


def _rank(host: str, **facts) -> dict:
    base = {"version.torch": "2.13.0", "seed": 42, "env.OMP_NUM_THREADS": "1"}
    return {"host": host, "facts": {**base, **facts}, "config": {}}


def test_identical_ranks_are_silent():
    assert compare_facts([_rank("node-a"), _rank("node-a"), _rank("node-b")]) == []


def test_a_differing_env_var_names_key_rank_host_and_values():
    found = compare_facts([_rank("node-a"), _rank("node-b", **{"env.OMP_NUM_THREADS": "4"})])
    assert [f["code"] for f in found] == ["env_mismatch"]
    f = found[0]
    assert f["rank"] == 1  # rank 0's value is the reference on a tie
    assert f["message"].startswith("OMP_NUM_THREADS differs across ranks: rank 1 (host node-b) has '4'; "
                                   "rank 0 (host node-a) has '1'")
    assert f["details"]["values"] == {0: "'1'", 1: "'4'"} and f["details"]["hosts"] == {0: "node-a", 1: "node-b"}


def test_majority_is_the_reference_and_unset_is_named():
    ranks = [_rank("a"), _rank("a"), _rank("b", **{"env.NCCL_ALGO": "Ring"}), _rank("b")]
    (f,) = compare_facts(ranks)
    assert f["rank"] == 2 and f["message"] == ("NCCL_ALGO differs across ranks: rank 2 (host b) has 'Ring'; "
                                               "ranks 0-1 (host a), 3 (host b) have (unset)")
    assert compare_facts(ranks, ignore=["env.NCCL_*"]) == []


def test_versions_seed_and_three_way_differences():
    found = compare_facts([_rank("a"), _rank("b", **{"version.torch": "2.12.1", "seed": 7}),
                           _rank("c", **{"version.torch": "2.11.0"})])
    by_code = {f["code"]: f for f in found}
    assert set(by_code) == {"version_mismatch", "seed_mismatch"}
    assert by_code["version_mismatch"]["rank"] is None  # three versions: no single culprit
    assert "rank 2 (host c) has '2.11.0'" in by_code["version_mismatch"]["message"]
    assert by_code["seed_mismatch"]["rank"] == 1 and "rank 1 (host b) has 7" in by_code["seed_mismatch"]["message"]


def test_secret_looking_values_never_leave_the_rank_but_still_compare():
    env = {"NCCL_X_PASSWORD": "hunter2", "TORCH_HUB_TOKEN": "tok-123", "OMP_NUM_THREADS": "2"}
    facts = env_facts(env)
    assert "hunter2" not in json.dumps(facts) and "tok-123" not in json.dumps(facts)
    other = env_facts({**env, "NCCL_X_PASSWORD": "swordfish"})
    ranks = [{"host": "a", "facts": facts, "config": {}}, {"host": "b", "facts": other, "config": {}}]
    (f,) = compare_facts(ranks)
    assert f["key"] == "env.NCCL_X_PASSWORD" and "***" in f["message"]
    text = json.dumps(f, default=str)
    assert "hunter2" not in text and "swordfish" not in text
    same = [{"host": "a", "facts": facts, "config": {}}, {"host": "b", "facts": env_facts(env), "config": {}}]
    assert compare_facts(same) == []


def test_env_facts_leave_out_what_differs_per_rank_by_design():
    env = {"RANK": "1", "LOCAL_RANK": "1", "MASTER_ADDR": "n0", "MASTER_PORT": "1", "TORCHELASTIC_RUN_ID": "x",
           "CUDA_VISIBLE_DEVICES": "3", "PL_GLOBAL_SEED": "42", "TORCH_EXTENSIONS_DIR": "/tmp/x", "CUDA_HOME": "/c",
           "SLURM_PROCID": "1", "HOME": "/h", "NCCL_DEBUG": "WARN", "TORCH_NCCL_BLOCKING_WAIT": "1",
           "OMP_NUM_THREADS": "2", "PYTHONHASHSEED": "0", "CUBLAS_WORKSPACE_CONFIG": ":4096:8", "GLOO_SOCKET_IFNAME": "lo"}
    assert set(env_facts(env)) == {"env.NCCL_DEBUG", "env.TORCH_NCCL_BLOCKING_WAIT", "env.OMP_NUM_THREADS",
                                   "env.PYTHONHASHSEED", "env.CUBLAS_WORKSPACE_CONFIG", "env.GLOO_SOCKET_IFNAME"}
    assert set(env_facts(env, ["OMP_*"])) == {"env.OMP_NUM_THREADS"}


def _cfg(run_dir: str, lr: float = 1e-3) -> object:
    return OmegaConf.create({"seed": 1, "paths": {"output_dir": run_dir, "cache_dir": "/c"},
                             "trainer": {"default_root_dir": "${paths.output_dir}"},
                             "callbacks": {"ckpt": {"dirpath": "${paths.output_dir}/checkpoints"}},
                             "data": {"tokenizer": "/c/tok/abc"}, "optim": {"lr": lr},
                             "logger": {"wandb": {"api_key": "sk-secret"}}})


def test_config_facts_ignore_where_files_go_and_name_differing_keys():
    a, b = config_facts(_cfg("/node0/run")), config_facts(_cfg("/node1/run"))
    assert a == b and a["trainer.default_root_dir"] == "<paths.output_dir>" and "seed" not in a
    assert a["logger.wandb.api_key"] == "***"
    facts = [{"host": h, "facts": {"config": "x" if h == "a" else "y"}, "config": c}
             for h, c in (("a", a), ("b", config_facts(_cfg("/node1/run", lr=3e-3))))]
    (f,) = compare_facts(facts)
    assert f["code"] == "config_mismatch" and f["message"].endswith("differing keys: optim.lr")


def test_rank_facts_are_this_process():
    mine = rank_facts(_cfg("/r"), torch.device("cpu"), environ={"OMP_NUM_THREADS": "3"})
    assert mine["host"] == socket.gethostname()
    facts = mine["facts"]
    assert facts["version.torch"] == torch.__version__ and facts["version.lightning"] and facts["seed"] == 1
    assert facts["env.OMP_NUM_THREADS"] == "3" and len(facts["config"]) == 16
    assert "gpu.model" not in facts  # a CPU rank has no GPU facts


@pytest.mark.parametrize("bad", [{"env": "NCCL_*"}, {"ignore": [1]}])
def test_bad_options_are_one_line_errors(bad):
    with pytest.raises(ConfigError, match=r"callbacks\.consistency\.(env|ignore)="):
        ConsistencyCheck(**bad)


def test_rank_payload_takes_only_this_ranks_small_text_files(tmp_path, monkeypatch):
    from dsdebug.findings import Finding, configure_channel

    channel = configure_channel(tmp_path)
    channel.report(Finding(check="c", severity="info", code="x", message="on rank 1", rank=1))
    for rel in ("ranks/rank1.json", "repro/rank1.json", "profiler/top_ops_rank1.json", "repro/rank10.json",
                "repro/rng_state_rank1.pt", "rank1.log", "notes.txt"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(rel)
    payload = rank_payload(tmp_path, 1)
    assert sorted(payload["files"]) == ["profiler/top_ops_rank1.json", "ranks/rank1.json", "repro/rank1.json"]
    assert [json.loads(line)["message"] for line in payload["findings"]] == ["on rank 1"]
    configure_channel(None)


def test_merge_adds_what_rank0_lacks_and_never_duplicates(tmp_path):
    line_a, line_b = json.dumps({"check": "c", "code": "a"}), json.dumps({"check": "c", "code": "b"})
    (tmp_path / "findings.jsonl").write_text(line_a + "\n")
    (tmp_path / "repro").mkdir()
    (tmp_path / "repro" / "rank1.json").write_text("rank 0 saw it")
    payload = {"rank": 1, "findings": [line_a, line_b],
               "files": {"repro/rank1.json": "other", "ranks/rank1.json": "{}", "../escape.txt": "no"}}
    assert merge_payloads(tmp_path, [None, payload]) == [1]
    assert merge_payloads(tmp_path, [None, payload]) == [1]  # twice: still no duplicates
    assert (tmp_path / "findings.jsonl").read_text().splitlines() == [line_a, line_b]
    assert (tmp_path / "repro" / "rank1.json").read_text() == "rank 0 saw it"
    assert (tmp_path / "ranks" / "rank1.json").read_text() == "{}"
    assert not (tmp_path.parent / "escape.txt").exists()


def _world(run_dir, collected: bool) -> None:
    ranks = [{"rank": 0, "host": "node-a", "pid": 1, "run_dir": str(run_dir), "shared": True},
             {"rank": 1, "host": "node-b", "pid": 2, "run_dir": "/local/run", "shared": False}]
    if collected:
        ranks[1]["collected"] = True
    (run_dir / "ranks").mkdir(exist_ok=True)
    (run_dir / "ranks" / "world.json").write_text(json.dumps({"world_size": 2, "ranks": ranks}))
    for e in ranks[:2 if collected else 1]:
        (run_dir / "ranks" / f"rank{e['rank']}.json").write_text(json.dumps({**e, "world_size": 2}))


def test_report_names_the_ranks_it_did_not_hear_from(tmp_path):
    from dsdebug.report.render import write_report

    _world(tmp_path, collected=False)
    text = write_report(tmp_path)[1].read_text()
    assert "| ranks heard from | 1 of 2: rank 0 (host node-a) |" in text
    assert ("| ranks not heard from | rank 1 (host node-b): their findings and files are not in this run dir (the run "
            "ended before they were collected); look in node-b:/local/run |") in text
    _world(tmp_path, collected=True)
    text = write_report(tmp_path)[1].read_text()
    assert ("| ranks heard from | 2 of 2: ranks 0 (host node-a), 1 (host node-b); rank 1 collected through the "
            "process group (node-local run dir) |") in text
    assert "not heard from" not in text


def test_rank_names_are_compact():
    assert rank_ranges([5, 0, 1, 2, 7, 8]) == "0-2, 5, 7-8"
    assert name_ranks([3]) == "rank 3"
    hosts = {r: f"h{r // 2}" for r in range(12)}
    assert name_ranks(range(12), hosts, max_hosts=2) == "ranks 0-1 (host h0), 2-3 (host h1), 4-11 (+4 more hosts)"


def test_log_lines_carry_the_host():
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "hello", None, None)
    line = HostFormatter(format="[%(hostname)s][%(levelname)s] - %(message)s").format(record)
    assert line == f"[{socket.gethostname()}][INFO] - hello"
