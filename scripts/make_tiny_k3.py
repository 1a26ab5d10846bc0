#!/usr/bin/env python3
"""Make ferry's embedded default model `models/tiny-k3/` and its parity golden data.

The model is a Hugging Face `DeepseekV3ForCausalLM` with Kimi K3's proportions at tiny scale:
12 attention heads (K3's per-rank count at TP8), low-rank q and kv projections, separate
qk_nope / qk_rope / v head dims, a dense first layer, sigmoid-gated routed experts with an
`e_score_correction_bias`, group-limited top-k, 2 shared experts, and YaRN RoPE. Its tokenizer is
a 2,048-token byte-level BPE trained with the `tokenizers` library on the King James Bible
(Debian's `bible-kjv`), and the model is briefly trained on the same text so that greedy
continuations are readable and have clear margins.

Everything is deterministic: fixed seeds, fixed data order, `torch.use_deterministic_algorithms`.

Stages (each can be run alone):
  corpus     write the cleaned KJV text (needs Debian's `bible` command)      -> --corpus
  tokenizer  train the BPE tokenizer on the corpus                           -> OUT/tokenizer.json
  train      initialise (seed 0) and train the model, save bf16 safetensors  -> OUT/model.safetensors
  golden     float32 reference logits and greedy continuations with transformers, on CPU
                                                                              -> OUT/golden/
  drafter    the embedded DSpark drafter for speculative decoding: config, random weights
             (seed 3, bf16) and a float32 torch reference of its forward on the golden prompts
                                                                              -> DRAFTER_OUT/
  train-drafter
             the same, with the drafter TRAINED against the frozen target (scripts/train_drafter.py:
             the target's greedy continuations of corpus prompts, random anchors, CE + KL to the
             target, confidence head by BCE), a held-out acceptance estimate in the log and in
             DRAFTER_OUT/train_report.json; runs on --device (default cuda if present);
             --drafter-long-* and --drafter-anchor-from add serving-shaped long contexts
                                                                              -> DRAFTER_OUT/

Typical use (the training stage is fast on a GPU, minutes on a CPU):
  python3 scripts/make_tiny_k3.py corpus --corpus /tmp/kjv.txt
  python3 scripts/make_tiny_k3.py tokenizer train --corpus /tmp/kjv.txt
  python3 scripts/make_tiny_k3.py golden
  python3 scripts/make_tiny_k3.py drafter
  python3 scripts/make_tiny_k3.py train-drafter --corpus device-bin/kjv.txt   # GPU: a few minutes
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "models" / "tiny-k3"
DEFAULT_DRAFTER_OUT = ROOT / "models" / "tiny-k3-dspark"

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
VOCAB_SIZE = 2048

# A chat template in the Hugging Face convention (rendered by minijinja in ferry).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    # Tool definitions (OpenAI's `tools`) as a system turn; ferry's tool-call format.
    "{% if tools %}<|system|>You can call these functions: "
    "{{ tools | tojson(separators=(',', ':')) }}. To call one, answer with only "
    "{\"name\":<its name>,\"arguments\":<an object of its parameters>}.<|end|>{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unknown role: ' ~ message['role']) }}"
    "{% endif %}"
    # Tool results are user turns; an assistant's tool calls are their JSON.
    "{% if message['role'] == 'tool' %}<|user|>{{ message['content'] }}<|end|>"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] %}<|assistant|>"
    "{% for call in message['tool_calls'] %}"
    "{{ {'name': call['function']['name'], 'arguments': call['function']['arguments']}"
    " | tojson(separators=(',', ':')) }}"
    "{% endfor %}<|end|>"
    "{% else %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

# K3 proportions at tiny scale. K3 (per rank at TP8): 12 heads, q_lora 1536, kv_lora 512,
# qk_nope 128, qk_rope 64, v 128, 896 experts top-16 + 2 shared, first layer dense.
MODEL_CONFIG = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=12,
    num_key_value_heads=12,
    q_lora_rank=96,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    n_routed_experts=16,
    num_experts_per_tok=4,
    n_group=4,
    topk_group=2,
    n_shared_experts=2,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    hidden_act="silu",
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    rope_interleave=True,
    rope_parameters=dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=4.0,
        original_max_position_embeddings=256,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=1.0,
        mscale_all_dim=1.0,
    ),
    tie_word_embeddings=False,
    attention_bias=False,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=None,
    initializer_range=0.02,
)

# Parity prompts: short, medium, and one longer than two 64-token KV pages.
GOLDEN_PROMPTS = [
    "In the beginning God created",
    "And the LORD spake unto Moses, saying, Speak unto the children of Israel,",
    (
        "Blessed is the man that walketh not in the counsel of the ungodly, nor standeth in the "
        "way of sinners, nor sitteth in the seat of the scornful. But his delight is in the law "
        "of the LORD; and in his law doth he meditate day and night. And he shall be like a tree "
        "planted by the rivers of water, that bringeth forth his fruit in his season; his leaf "
        "also shall not wither; and whatsoever he doeth shall prosper. The ungodly are not so: "
        "but are like the chaff which the wind driveth away. Therefore the ungodly shall not "
        "stand in the judgment, nor sinners in the congregation of the righteous. For the LORD "
        "knoweth the way of the righteous: but the way of the ungodly shall perish. Why do the "
        "heathen rage, and the people imagine a vain thing?"
    ),
]
GOLDEN_NEW_TOKENS = 32


def stage_corpus(args: argparse.Namespace) -> None:
    """Write one verse per line, references stripped, from Debian's `bible` command."""
    raw = subprocess.run(
        ["bible", "-f", "gen1:1-rev22:21"], check=True, capture_output=True, text=True
    ).stdout
    lines = []
    for line in raw.splitlines():
        text = re.sub(r"^\S+\d+:\d+\s+", "", line).strip()
        if text:
            lines.append(text)
    Path(args.corpus).write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"corpus: {len(lines)} verses -> {args.corpus}")


def stage_tokenizer(args: argparse.Namespace) -> None:
    train_bpe_tokenizer([str(args.corpus)], VOCAB_SIZE, Path(args.out),
                        MODEL_CONFIG["max_position_embeddings"])


def train_bpe_tokenizer(files: list, vocab_size: int, out: Path, model_max_length: int) -> None:
    """A byte-level BPE with ferry's special tokens (`<|bos|>` = 0, `<|eos|>` = 1, ...), BOS
    prepended by the post-processor, and the chat template: OUT/tokenizer.json and
    OUT/tokenizer_config.json. Also used by scripts/make_corpus.py for the trained target."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", special_tokens=[("<|bos|>", 0)]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(files, trainer)
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    assert tok.token_to_id("<|bos|>") == 0 and tok.token_to_id("<|eos|>") == 1
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<|bos|>",
                "eos_token": "<|eos|>",
                "chat_template": CHAT_TEMPLATE,
                "model_max_length": model_max_length,
                "tokenizer_class": "PreTrainedTokenizerFast",
            },
            indent=2,
        )
        + "\n"
    )
    print(f"tokenizer: {tok.get_vocab_size()} tokens -> {out}")


def build_model(torch):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    config = DeepseekV3Config(**MODEL_CONFIG)
    model = DeepseekV3ForCausalLM(config)
    # The correction bias is a buffer the HF init zeroes; give it real values so the test data
    # exercises the "bias changes selection but not weights" rule of noaux_tc routing.
    gen = torch.Generator().manual_seed(1)
    for layer in model.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None:
            gate.e_score_correction_bias.copy_(
                torch.randn(gate.e_score_correction_bias.shape, generator=gen) * 0.05
            )
    return config, model


def to_deepseek_state_dict(model) -> dict:
    """The state dict in the original DeepSeek-V3 checkpoint layout (one tensor per expert
    projection), which is what real DeepSeek-V3 / Kimi K2 checkpoints look like on disk."""
    import torch

    out = {}
    for name, t in model.state_dict().items():
        m = re.match(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$", name)
        if m is None:
            out[name] = t
            continue
        prefix, kind = m.groups()
        for e in range(t.shape[0]):
            if kind == "gate_up_proj":
                gate, up = t[e].chunk(2, dim=0)
                out[f"{prefix}.{e}.gate_proj.weight"] = gate
                out[f"{prefix}.{e}.up_proj.weight"] = up
            else:
                out[f"{prefix}.{e}.down_proj.weight"] = t[e]
    # Real checkpoints keep the correction bias in f32 and everything else in bf16.
    for name in list(out):
        if name.endswith("e_score_correction_bias"):
            out[name] = out[name].to(torch.float32).contiguous()
        else:
            out[name] = out[name].to(torch.bfloat16).contiguous()
    return out


def write_hf_config(config, out: Path) -> None:
    """OUT/config.json as a Hugging Face checkpoint has it (bf16 weights); also used by
    scripts/train_target.py."""
    cfg = config.to_dict()
    cfg["architectures"] = ["DeepseekV3ForCausalLM"]
    cfg["torch_dtype"] = "bfloat16"
    for k in ("transformers_version", "dtype"):
        cfg.pop(k, None)
    (Path(out) / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def stage_train(args: argparse.Namespace) -> None:
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    out = Path(args.out)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    text = Path(args.corpus).read_text(encoding="utf-8")
    ids = torch.tensor(tok.encode(text, add_special_tokens=False).ids, dtype=torch.long)
    print(f"train: {ids.numel()} corpus tokens on {device}")

    config, model = build_model(torch)
    model.to(device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=args.lr, total_steps=args.steps, pct_start=0.05
    )
    gen = torch.Generator().manual_seed(2)
    seq = args.seq_len
    for step in range(args.steps):
        starts = torch.randint(0, ids.numel() - seq - 1, (args.batch,), generator=gen)
        batch = torch.stack([ids[s : s + seq] for s in starts.tolist()]).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            # transformers shifts the labels itself: label t is predicted from tokens < t.
            loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 100 == 0 or step == args.steps - 1:
            print(f"step {step:5d} loss {loss.item():.3f}", flush=True)

    model.to("cpu")
    state = to_deepseek_state_dict(model)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    write_hf_config(config, out)
    nparams = sum(t.numel() for t in state.values())
    print(f"train: saved {nparams} parameters -> {out}")


def stage_golden(args: argparse.Namespace) -> None:
    """Float32 reference on CPU: logits at every prompt position and 32 greedy tokens."""
    import torch
    import transformers
    from safetensors.torch import save_file
    from tokenizers import Tokenizer
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(0)
    out = Path(args.out)
    gold = out / "golden"
    gold.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    model = DeepseekV3ForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    model.eval()
    # Guard against a silent checkpoint-layout mismatch: every routed expert must have loaded.
    missing = [n for n, p in model.named_parameters() if torch.all(p == 0) and "bias" not in n]
    assert not missing, f"parameters left at zero after loading: {missing}"

    # Sanity check that the checkpoint is the trained model: next-token loss on a fixed slice of
    # the corpus (an untrained model scores ~7.6 = ln 2048).
    corpus = Path(args.corpus)
    if corpus.exists():
        sample = corpus.read_text(encoding="utf-8")[100_000:104_000]
        ids = torch.tensor([tok.encode(sample, add_special_tokens=False).ids[:512]])
        with torch.no_grad():
            loss = model(input_ids=ids, labels=ids).loss.item()
        print(f"golden: next-token loss on a corpus slice {loss:.3f}")
        assert loss < 4.0, "the checkpoint does not look trained"

    tensors = {}
    cases = []
    for i, prompt in enumerate(GOLDEN_PROMPTS):
        prompt_ids = tok.encode(prompt, add_special_tokens=True).ids
        input_ids = torch.tensor([prompt_ids])
        with torch.no_grad():
            logits = model(input_ids=input_ids).logits[0].float()
            gen = model.generate(
                input_ids=input_ids,
                max_new_tokens=GOLDEN_NEW_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=1,
                output_scores=True,
                output_logits=True,
                return_dict_in_generate=True,
            )
        new_tokens = gen.sequences[0, len(prompt_ids) :].tolist()
        margins = []
        for step_logits in gen.logits:
            top2 = torch.topk(step_logits[0].float(), 2).values
            margins.append(float(top2[0] - top2[1]))
        tensors[f"prompt{i}.logits"] = logits.contiguous()
        cases.append(
            {
                "prompt": prompt,
                "prompt_ids": prompt_ids,
                "greedy_ids": new_tokens,
                "greedy_text": tok.decode(new_tokens, skip_special_tokens=False),
                "min_greedy_margin": min(margins),
                "logits_tensor": f"prompt{i}.logits",
                "max_abs_logit": float(logits.abs().max()),
            }
        )
        print(f"golden {i}: {len(prompt_ids)} prompt tokens, min margin {min(margins):.4f}")
        print(f"  {prompt[:40]!r} -> {cases[-1]['greedy_text']!r}")
    save_file(tensors, str(gold / "logits.safetensors"))
    meta = {
        "produced_by": "scripts/make_tiny_k3.py golden",
        "reference": "transformers DeepseekV3ForCausalLM, float32, CPU, eager attention",
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "cases": cases,
    }
    (gold / "cases.json").write_text(json.dumps(meta, indent=2) + "\n")


# The embedded DSpark drafter (docs/spec_decode.md): a DFlash-style block drafter with DSpark's
# Markov and confidence heads, at tiny scale. Hidden size and vocabulary are the target's (the
# embedding and LM head are shared); taps after target layers 1 and 2 of 4; K/V rows of
# 2 × 2 × 32 = 128 floats, which the ferry drafter pool splits over two 80-wide target rows.
DRAFTER_CONFIG = dict(
    architectures=["DSparkDrafter"],
    hidden_size=MODEL_CONFIG["hidden_size"],
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=512,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    vocab_size=VOCAB_SIZE,
    target_layer_ids=[1, 2],
    block_size=4,
    # `<|system|>`: a special token that never appears inside a generated continuation.
    mask_token_id=4,
    markov_rank=32,
)


def drafter_state_dict(torch, cfg: dict) -> dict:
    """Random drafter weights (seed 3): normal(0, 0.02) matrices, unit norms, rounded to bf16."""
    gen = torch.Generator().manual_seed(3)
    hid, hd = cfg["hidden_size"], cfg["head_dim"]
    heads, kvh = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    inter, vocab, rank = cfg["intermediate_size"], cfg["vocab_size"], cfg["markov_rank"]
    taps = len(cfg["target_layer_ids"])

    def mat(rows, cols):
        return torch.randn(rows, cols, generator=gen) * 0.02

    state = {"fc.weight": mat(hid, hid * taps), "hidden_norm.weight": torch.ones(hid)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}"
        state.update(
            {
                f"{p}.input_layernorm.weight": torch.ones(hid),
                f"{p}.self_attn.q_proj.weight": mat(heads * hd, hid),
                f"{p}.self_attn.k_proj.weight": mat(kvh * hd, hid),
                f"{p}.self_attn.v_proj.weight": mat(kvh * hd, hid),
                f"{p}.self_attn.o_proj.weight": mat(hid, heads * hd),
                f"{p}.self_attn.q_norm.weight": torch.ones(hd),
                f"{p}.self_attn.k_norm.weight": torch.ones(hd),
                f"{p}.post_attention_layernorm.weight": torch.ones(hid),
                f"{p}.mlp.gate_proj.weight": mat(inter, hid),
                f"{p}.mlp.up_proj.weight": mat(inter, hid),
                f"{p}.mlp.down_proj.weight": mat(hid, inter),
            }
        )
    state.update(
        {
            "norm.weight": torch.ones(hid),
            "markov_head.w1.weight": torch.randn(vocab, rank, generator=gen) * 0.02,
            "markov_head.w2.weight": mat(vocab, rank),
            "confidence_head.weight": mat(1, hid + rank),
            "confidence_head.bias": torch.zeros(1),
        }
    )
    return {k: v.to(torch.bfloat16).contiguous() for k, v in state.items()}


def _train_drafter_module():
    """scripts/train_drafter.py: the batched torch forward of the drafter, shared by the golden
    reference and the training stage."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import train_drafter

    return train_drafter


def drafter_reference(torch, cfg: dict, w: dict, target, prompt_ids: list, anchor: int) -> dict:
    """The drafter's forward in float32 torch (ferry's dspark.rs / heads.rs; see
    scripts/train_drafter.py, whose batched forward the training stage uses too): context feature
    from the target's hidden states after `target_layer_ids`, context K/V per layer, one pass over
    [anchor, MASK x (B-1)] (block queries only, bidirectional, all context visible), the target's
    LM head, then the Markov head left to right with greedy drafts and the confidence head."""
    return _train_drafter_module().reference(cfg, w, target, prompt_ids, anchor)


def write_drafter(args: argparse.Namespace, state: dict, produced_by: str, weights: str,
                  cfg: dict | None = None) -> None:
    """Writes DRAFTER_OUT: config.json, the bf16 weights `state`, and the float32 golden reference
    of the drafter on the target's golden prompts (computed on the CPU; only for a target with
    golden data, i.e. the embedded tiny-k3)."""
    import torch
    import transformers
    from safetensors.torch import save_file
    from transformers import DeepseekV3ForCausalLM

    cfg = DRAFTER_CONFIG if cfg is None else cfg
    out = Path(args.drafter_out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    nparams = sum(t.numel() for t in state.values())
    print(f"drafter: {nparams} parameters ({weights}) -> {out}")

    target_dir = Path(args.out)
    if not (target_dir / "golden" / "cases.json").exists():
        print(f"drafter: no golden data in {target_dir}: no drafter golden reference written")
        return
    (out / "golden").mkdir(parents=True, exist_ok=True)
    target = DeepseekV3ForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32)
    target.eval()
    target_cases = json.loads((target_dir / "golden" / "cases.json").read_text())["cases"]
    tensors, cases = {}, []
    for i, tc in enumerate(target_cases):
        # The anchor is the target's own greedy next token, as in a real decode step.
        anchor = tc["greedy_ids"][0]
        ref = drafter_reference(torch, cfg, state, target, tc["prompt_ids"], anchor)
        tensors[f"case{i}.block_logits"] = ref["block_logits"]
        tensors[f"case{i}.markov_logits"] = ref["markov_logits"]
        cases.append(
            {
                "prompt_ids": tc["prompt_ids"],
                "anchor": anchor,
                "greedy_drafts": ref["drafts"],
                "confidence": ref["confidence"],
                "min_draft_margin": ref["min_draft_margin"],
            }
        )
        print(
            f"drafter golden {i}: {len(tc['prompt_ids'])} context tokens, drafts {ref['drafts']}, "
            f"target's greedy tokens {tc['greedy_ids'][1:1 + len(ref['drafts'])]}"
        )
    save_file(tensors, str(out / "golden" / "logits.safetensors"))
    meta = {
        "produced_by": produced_by,
        "reference": "float32 torch on CPU (drafter_reference), target via transformers DeepseekV3ForCausalLM",
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "cases": cases,
    }
    (out / "golden" / "cases.json").write_text(json.dumps(meta, indent=2) + "\n")


def stage_drafter(args: argparse.Namespace) -> None:
    import torch

    state = drafter_state_dict(torch, DRAFTER_CONFIG)
    write_drafter(args, state, "scripts/make_tiny_k3.py drafter", "random, seed 3")


def stage_train_drafter(args: argparse.Namespace) -> None:
    """Trains the drafter (initialised with the seed-3 random weights) against the frozen target
    on the target's own greedy continuations of corpus prompts (scripts/train_drafter.py), then
    writes it like `drafter` does, with the golden reference of the trained weights."""
    import torch

    td = _train_drafter_module()
    cfg = drafter_config_for_target(args)
    init = drafter_state_dict(torch, cfg)
    state, report = td.train(args, cfg, init, Path(args.out))
    write_drafter(args, state, "scripts/make_tiny_k3.py train-drafter", "trained", cfg)
    td.write_report(Path(args.drafter_out), report)


def drafter_config_for_target(args: argparse.Namespace) -> dict:
    """The drafter config for the target in --out: --drafter-config if given; the embedded
    DRAFTER_CONFIG for the embedded target (tiny-k3's hidden size, vocabulary and depth); else one
    derived from the target's config.json (`derive_drafter_config`)."""
    if args.drafter_config:
        return json.loads(Path(args.drafter_config).read_text())
    target = json.loads((Path(args.out) / "config.json").read_text())
    keys = ("hidden_size", "vocab_size", "num_hidden_layers")
    if all(target[k] == MODEL_CONFIG[k] for k in keys) and not (
        args.drafter_layers or args.drafter_block_size or args.drafter_taps
    ):
        return DRAFTER_CONFIG
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(args.out) / "tokenizer.json"))
    taps = [int(x) for x in args.drafter_taps.split(",")] if args.drafter_taps else None
    cfg = derive_drafter_config(target, tok.token_to_id("<|system|>"), args.drafter_layers or 2,
                                args.drafter_block_size or 8, taps)
    print(f"drafter: config derived from {args.out}: {json.dumps(cfg)}")
    return cfg


def derive_drafter_config(target: dict, mask_token_id: int, layers: int, block_size: int,
                          taps: list | None = None) -> dict:
    """A DSpark drafter for any DeepSeek-V3-family target, in DRAFTER_CONFIG's proportions: the
    target's hidden size and vocabulary, head_dim 32 (64 from hidden 512), 2 KV heads, SwiGLU of
    2 x hidden, taps evenly spaced from layer 1 to layer L - 3 (DFlash's rule; 3 taps from 12
    target layers, else 2), Markov rank 32 (64 from hidden 512). For tiny-k3's config this gives
    DRAFTER_CONFIG with the requested block size and layer count."""
    hid, depth = target["hidden_size"], target["num_hidden_layers"]
    head_dim = 64 if hid >= 512 else 32
    if taps is None:
        n = 3 if depth >= 12 else 2
        last = max(depth - 3, n)
        taps = sorted({round(1 + i * (last - 1) / (n - 1)) for i in range(n)})
    assert all(0 <= t < depth for t in taps), f"taps {taps} outside the target's {depth} layers"
    return dict(
        architectures=["DSparkDrafter"],
        hidden_size=hid,
        num_hidden_layers=layers,
        num_attention_heads=hid // head_dim,
        num_key_value_heads=2,
        head_dim=head_dim,
        intermediate_size=2 * hid,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        vocab_size=target["vocab_size"],
        target_layer_ids=taps,
        block_size=block_size,
        # `<|system|>`: a special token that never appears inside a generated continuation.
        mask_token_id=mask_token_id,
        markov_rank=64 if hid >= 512 else 32,
    )


def add_train_drafter_args(p: argparse.ArgumentParser) -> None:
    """The train-drafter stage's options (GPU-sized defaults)."""
    g = p.add_argument_group("train-drafter")
    g.add_argument("--drafter-steps", type=int, default=3000)
    g.add_argument("--drafter-batch", type=int, default=128, help="sequences per step")
    g.add_argument("--drafter-anchors", type=int, default=32, help="anchors (blocks) per sequence per step")
    g.add_argument("--drafter-lr", type=float, default=2e-3)
    g.add_argument("--drafter-seqs", type=int, default=16384, help="training sequences the target generates")
    g.add_argument("--drafter-eval-seqs", type=int, default=256,
                   help="held-out sequences, each for validation and for test")
    g.add_argument("--drafter-seq-len", type=int, default=192, help="prompt + greedy continuation")
    g.add_argument("--drafter-prompt-lens", default="8,16,32,64", help="prompt lengths, one per generate batch in turn")
    g.add_argument("--drafter-gen-batch", type=int, default=4096, help="sequences per target.generate call")
    g.add_argument("--drafter-random-prompts", type=float, default=0.1,
                   help="fraction of prompts made of random tokens (like bench-engine's)")
    g.add_argument("--drafter-ce-weight", type=float, default=1.0)
    g.add_argument("--drafter-kl-weight", type=float, default=0.5, help="KL(target || draft) weight")
    g.add_argument("--drafter-conf-weight", type=float, default=1.0)
    g.add_argument("--drafter-pos-decay", type=float, default=4.0, help="position weight exp(-k / decay)")
    g.add_argument("--drafter-eval-stride", type=int, default=1, help="every n-th anchor of held-out sequences")
    g.add_argument("--drafter-eval-batch", type=int, default=16, help="held-out sequences per eval forward")
    g.add_argument("--drafter-eval-every", type=int, default=500,
                   help="validate every n steps; the best validated weights are kept")
    g.add_argument("--drafter-calib-steps", type=int, default=300,
                   help="refit the confidence head on validation data (0: keep the trained one)")
    g.add_argument("--drafter-time-budget", type=float, default=0,
                   help="stop the training loop after this many seconds (0: no limit)")
    g.add_argument("--drafter-log-every", type=int, default=100)
    g.add_argument("--drafter-seed", type=int, default=5)
    g.add_argument("--drafter-config", default=None,
                   help="drafter config.json to train (default: the embedded one for tiny-k3, else "
                        "derived from the target's config)")
    g.add_argument("--drafter-layers", type=int, default=0, help="derived config: drafter layers (2)")
    g.add_argument("--drafter-block-size", type=int, default=0, help="derived config: block size (8)")
    g.add_argument("--drafter-taps", default="", help="derived config: target layers tapped, e.g. 1,9,17")
    g.add_argument("--drafter-corpus-mb", type=float, default=16.0,
                   help="corpus directory (scripts/make_corpus.py): MB of train text to draw prompts from")
    # Serving-shaped data (docs/spec_decode.md, "The drafter against it"): anchors inside the
    # prompt, and a second data part of long corpus prompts with a short generated tail.
    g.add_argument("--drafter-anchor-from", type=int, default=-1,
                   help="anchors from this position on, inside the prompt too (labels only where the "
                        "text follows the target's greedy chain); -1: from the last prompt position")
    g.add_argument("--drafter-pack-splits", action="store_true",
                   help="generate the train, validation and test prompts of one length in shared "
                        "generate calls (fewer generated steps; the long part always does)")
    g.add_argument("--drafter-long-prompt-lens", default="",
                   help="long part: corpus prompt lengths, e.g. 1024 (empty: no long part)")
    g.add_argument("--drafter-long-seq-len", type=int, default=1088,
                   help="long part: prompt + greedy tail")
    g.add_argument("--drafter-long-seqs", type=int, default=336, help="long part: training sequences")
    g.add_argument("--drafter-long-eval-seqs", type=int, default=72,
                   help="long part: held-out sequences, each for validation and for test")
    g.add_argument("--drafter-long-share", type=float, default=0.25,
                   help="long part: share of each step's --drafter-batch sequences")
    g.add_argument("--drafter-long-tail-share", type=float, default=0.5,
                   help="long part: share of a sequence's anchors in the generated tail (the others "
                        "in the prompt from --drafter-anchor-from on)")
    g.add_argument("--drafter-long-gen-tokens", type=int, default=262144,
                   help="long part: at most this many tokens (sequences x seq len) per generate call; "
                        "the sequences per call are min(--drafter-gen-batch, this / seq len)")


STAGES = ["corpus", "tokenizer", "train", "golden", "drafter", "train-drafter"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("stages", nargs="+", choices=STAGES)
    p.add_argument("--out", default=str(DEFAULT_OUT))
    p.add_argument("--drafter-out", default=str(DEFAULT_DRAFTER_OUT))
    p.add_argument("--corpus", default="/tmp/kjv.txt")
    p.add_argument("--device", default=None, help="torch device for training (default: cuda if present)")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    add_train_drafter_args(p)
    args = p.parse_args()
    stages = {
        "corpus": stage_corpus,
        "tokenizer": stage_tokenizer,
        "train": stage_train,
        "golden": stage_golden,
        "drafter": stage_drafter,
        "train-drafter": stage_train_drafter,
    }
    for name in STAGES:
        if name in args.stages:
            stages[name](args)


if __name__ == "__main__":
    sys.exit(main())
