"""Tokenizers: a Hugging Face tokenizer.json (through the `tokenizers` library) with its jinja chat template,
and a byte-level stand-in for random-weight models."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from jinja2.sandbox import ImmutableSandboxedEnvironment


class TemplateError(ValueError):
    pass


def _raise(message: str):
    raise TemplateError(message)


class Tokenizer:
    """Text <-> int64 token ids. Never adds special tokens to plain text; the chat template adds its own."""

    def __init__(self, tokenizer_json: Path, chat_template: str | None, special: dict[str, str | None]):
        from tokenizers import Tokenizer as HFTokenizer

        self._tok = HFTokenizer.from_file(str(tokenizer_json))
        self.chat_template = chat_template
        self.special = special
        self.vocab_size = self._tok.get_vocab_size()
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._template = env.from_string(chat_template) if chat_template else None

    @classmethod
    def from_folder(cls, folder: str | Path) -> Tokenizer:
        folder = Path(folder)
        cfg_path = folder / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        template = cfg.get("chat_template")
        jinja = folder / "chat_template.jinja"
        if template is None and jinja.exists():
            template = jinja.read_text()
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)

        def tok(name):
            v = cfg.get(name)
            return v.get("content") if isinstance(v, dict) else v

        special = {k: tok(k) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        return cls(folder / "tokenizer.json", template, special)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if self._template is None:
            raise TemplateError("this model has no chat template")
        kwargs = {k: (v or "") for k, v in self.special.items()}
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **kwargs)

    def encode_chat(self, prompt: str) -> list[int]:
        return self.encode(self.apply_chat_template([{"role": "user", "content": prompt}]))


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, for random-weight models; larger ids decode to nothing."""

    chat_template = None
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def token_to_id(self, token: str) -> int | None:
        return None

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        raise TemplateError("random-weight models have no chat template")

    def encode_chat(self, prompt: str) -> list[int]:
        self.apply_chat_template([])
        return []
