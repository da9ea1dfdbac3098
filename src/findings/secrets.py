"""Keep secrets out of everything the framework writes (config dumps, hparams, reports)."""

from __future__ import annotations

import re
from typing import Any

__all__ = ["REDACTED", "SECRET_KEY", "redact", "redact_text"]

# "token" (hf_token, access_token, WANDB_TOKEN) but not "tokenizer" (a path), "tokens" (counts such as
# data.max_tokens), a token budget or id (data.token_budget, token_budget_lr, pad_token_id) or a tokenizer's
# special token (pad_token, eos_token: their values are strings such as "</s>")
SECRET_KEY = re.compile(r"(api[_-]?key|(?<!pad_)(?<!eos_)(?<!bos_)(?<!unk_)(?<!sep_)(?<!cls_)(?<!mask_)"
                        r"token(?!izer|s|_budget|_id)|secret|password|passwd|credential|auth)", re.IGNORECASE)
REDACTED = "***"


def redact(obj: Any) -> Any:
    """A copy of a plain container with values under secret-looking keys replaced."""
    if isinstance(obj, dict):
        return {k: (REDACTED if SECRET_KEY.search(str(k)) and v not in (None, "") else redact(v)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [redact(v) for v in obj]
    return obj


_SECRET_ASSIGNMENT = re.compile(r"(?P<key>[\w.-]*(?:" + SECRET_KEY.pattern + r")[\w.-]*)(?P<sep>\s*[=:]\s*)"
                                r"(?P<q>['\"]?)[^\s,;'\"]+(?P=q)", re.IGNORECASE)


def redact_text(text: str) -> str:
    """Free text (a finding's message) with the value of each ``<secret-looking key>=<value>`` replaced."""
    return _SECRET_ASSIGNMENT.sub(lambda m: f"{m.group('key')}{m.group('sep')}{REDACTED}", text)
