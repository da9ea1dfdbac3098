"""Bad values of data.packing / data.token_budget / data.token_budget_lr: one line naming the key and what
is valid, from the composed config (src/config/validate.py, before torch is imported: ~1 s), and again
from LMDataModule's own checks for direct use. docs/bad_inputs.md rows 83-87."""

from __future__ import annotations

import re

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from dsdebug.config.validate import validate_config
from dsdebug.errors import ConfigError
from tests.helpers.bad_input import assert_one_line_error, cli_error_lines
from tests.helpers.runs import CONF, SMOKE

CASES = {
    "packing_not_bool": (["data.packing=maybe"], "data.packing='maybe' is invalid; valid: true, false"),
    "token_budget_below_seq_len": (["data.token_budget=64"],
                                   "data.token_budget must be null or an int >= data.seq_len=128 (tokens per rank "
                                   "per step), got 64"),
    "token_budget_lr_typo": (["data.token_budget=1024", "data.token_budget_lr=linea"],
                             "data.token_budget_lr='linea' is invalid; valid: none, linear, sqrt"),
    "token_budget_lr_without_budget": (["data.token_budget_lr=sqrt"],
                                       "data.token_budget_lr=sqrt needs data.token_budget=<tokens>"),
    "packing_on_synthetic": (["data=synthetic", "data.packing=true"],
                             "data.packing=true: a synthetic source has no documents to pack"),
    "global_batch_with_token_budget": (["data.token_budget=1024", "data.global_batch_size=16"],
                                       "data.global_batch_size=16 does not apply with data.token_budget=1024"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_packing_value_is_one_line_naming_the_key(case, tmp_path, shared_cache, capsys):
    overrides, text = CASES[case]
    assert_one_line_error(cli_error_lines(SMOKE + overrides, tmp_path, shared_cache, capsys), [text])


@pytest.mark.parametrize("case", sorted(CASES))
def test_refused_by_the_static_validation(case):
    """The layer that refuses it is validate_config on the composed config (no torch needed)."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=SMOKE + CASES[case][0] + ["paths.cache_dir=/tmp"])
    with pytest.raises(ConfigError, match=re.escape(CASES[case][1])):
        validate_config(cfg)


def test_the_defaults_change_nothing():
    """Off by default on every document-aware data config (and on synthetic, where it is refused)."""
    for data in ("kjv", "text_files", "hf_dataset", "synthetic"):
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            cfg = compose("train", overrides=[f"data={data}"])
        assert (cfg.data.packing, cfg.data.token_budget, cfg.data.token_budget_lr) == (False, None, "none")


def test_the_datamodule_refuses_the_same_when_built_directly():
    from dsdebug.data.corpus import KJVCorpus, SyntheticCorpus
    from dsdebug.data.datamodule import LMDataModule

    with pytest.raises(ConfigError, match=r"data.packing=true: a synthetic source"):
        LMDataModule(SyntheticCorpus(num_tokens=1000), vocab_size=64, packing=True)
    with pytest.raises(ConfigError, match=r"data.token_budget must be null or an int >= data.seq_len=128"):
        LMDataModule(KJVCorpus(), token_budget=100)
    with pytest.raises(ConfigError, match=r"data.token_budget_lr='cube' is invalid; valid: none, linear, sqrt"):
        LMDataModule(KJVCorpus(), token_budget=256, token_budget_lr="cube")
