"""Data pipeline: text sources (`corpus`), cached byte-level BPE (`tokenizer`), and the
packed-block `LMDataModule` (`datamodule`). Configs live in `conf/data/*.yaml`."""

from src.data.corpus import HFDatasetCorpus, KJVCorpus, SyntheticCorpus, TextFilesCorpus
from src.data.datamodule import LMDataModule

__all__ = ["HFDatasetCorpus", "KJVCorpus", "LMDataModule", "SyntheticCorpus", "TextFilesCorpus"]
