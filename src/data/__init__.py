"""Data pipeline: text sources (`corpus`), cached byte-level BPE (`tokenizer`), and the
packed-block `LMDataModule` (`datamodule`). Configs live in `conf/data/*.yaml`."""

from dsdebug.data.corpus import HFDatasetCorpus, KJVCorpus, SyntheticCorpus, TextFilesCorpus
from dsdebug.data.datamodule import LMDataModule

__all__ = ["HFDatasetCorpus", "KJVCorpus", "LMDataModule", "SyntheticCorpus", "TextFilesCorpus"]
