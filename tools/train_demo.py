"""Train glmcore's built-in demo model: a small ChatGLM3 that writes classical Chinese poems.

Corpus: the Tang and Song shi of the npm package `chinese-poetry` (MIT, (c) 2016 JackeyGao), a
training input only: `cd /tmp && npm pack chinese-poetry && mkdir cp && tar xzf chinese-poetry-*.tgz -C cp`.
Traditional characters are converted to simplified with OpenCC (pip install opencc; t2s) when it is
installed. Only regular 五言/七言 绝句 and 律诗 (4 or 8 lines of 5 or 7 Han characters) are kept.

    python tools/train_demo.py data --src /tmp/cp/package/dist --work /tmp/demo    # samples + split
    python tools/train_demo.py tokenizer --work /tmp/demo                          # SentencePiece BPE
    python tools/train_demo.py train --work /tmp/demo --minutes 70                 # checkpoints in work/ckpt
    python tools/train_demo.py export --work /tmp/demo --out glmcore/data/demo-chatglm3-poet
    python tools/train_demo.py plot --work /tmp/demo --out glmcore/data/demo-chatglm3-poet/loss.png

The model is written in the real ChatGLM3 layout (config.json keys, safetensors tensor names, a
SentencePiece tokenizer.model with ChatGLM3's special tokens numbered after its pieces), so every
backend loads it like a checkpoint from the hub. The training forward (`forward`) is the torch
reference's math (plugins/torch_ref: the RMSNorm kernel, rotary_tables, apply_rotary), batched and
trainable; tests/test_demo_model.py checks that its logits equal the reference backend's.
Only the torch needed here is a tool dependency (training); glmcore's runtime does not use this file.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SEED = 1234
HAN = re.compile(r"[\u4e00-\u9fff]")
LINE_SPLIT = re.compile(r"[，。！？]")

# The model's shape (ChatGLM3's architecture, scaled down; see the model card).
ARCH = dict(hidden_size=256, num_layers=6, num_attention_heads=4, multi_query_group_num=2, kv_channels=64,
            ffn_hidden_size=704)
N_PIECES = 4608          # SentencePiece pieces (3 control + 256 byte pieces included); + 9 special tokens
SEQ_LEN = 256
N_CHARS = 3900         # characters kept as pieces (the rarer ones fall back to UTF-8 bytes)

# Instruction templates (user turn) -> the assistant turn is the poem (续写: the lines after the first).
KIND = {(5, 4): "五言绝句", (7, 4): "七言绝句", (5, 8): "五言律诗", (7, 8): "七言律诗"}


# ----------------------------------------------------------------------------------------- data

def clean_title(title: str) -> str | None:
    t = re.sub(r"[（(【\[].*?[）)】\]]", "", title)
    t = t.split(" ")[0].strip()
    t = re.sub(r"(其[一二三四五六七八九十]+|[一二三四五六七八九十]+首)$", "", t).strip()
    if not t or len(t) > 12 or not all(HAN.match(c) for c in t):
        return None
    return t


def regular_poem(paragraphs: list[str]) -> tuple[int, int, list[str]] | None:
    """(chars per line, number of lines, couplets) of a regular 五言/七言 绝句/律诗, else None."""
    text = "".join(p.strip() for p in paragraphs)
    if not text or not text.endswith(("。", "！", "？")):
        return None
    lines = [x for x in LINE_SPLIT.split(text) if x]
    if len(lines) not in (4, 8):
        return None
    n = len(lines[0])
    if n not in (5, 7) or any(len(x) != n or not all(HAN.match(c) for c in x) for x in lines):
        return None
    couplets = re.findall(r"[^。！？]+[。！？]", text)
    if len(couplets) != len(lines) // 2 or any("，" not in c for c in couplets):
        return None
    return n, len(lines), couplets


def cmd_data(a) -> None:
    src, work = Path(a.src), Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    try:
        import opencc
        conv = opencc.OpenCC("t2s").convert
        converted = "OpenCC t2s"
    except ImportError:
        conv = lambda s: s   # noqa: E731
        converted = "none (opencc not installed: traditional characters kept)"
    poems, seen = [], set()
    files = sorted((src / "quantangshi").glob("poet.*.json"), key=lambda p: (p.name.split(".")[1], int(p.name.split(".")[2])))
    for f in files:
        for p in json.loads(f.read_text(encoding="utf-8")):
            body = conv("".join(p.get("paragraphs") or []))
            r = regular_poem([body])
            if r is None:
                continue
            n, k, couplets = r
            key = "".join(couplets)
            if key in seen:
                continue
            seen.add(key)
            poems.append({"title": clean_title(conv(p.get("title") or "")), "author": conv(p.get("author") or ""),
                          "dynasty": f.name.split(".")[1], "n": n, "k": k, "couplets": couplets})
    rng = random.Random(SEED)
    rng.shuffle(poems)
    n_test = max(500, len(poems) // 50)
    split = {"test": poems[:n_test], "train": poems[n_test:]}
    for name, ps in split.items():
        with open(work / f"{name}.jsonl", "w", encoding="utf-8") as out:
            for p in ps:
                out.write(json.dumps(p, ensure_ascii=False) + "\n")
    # Held-out plain text for `glmcore eval --perplexity` (tests/data/demo_heldout_poems.txt).
    (work / "heldout_poems.txt").write_text("".join("".join(p["couplets"]) + "\n" for p in split["test"][:600]),
                                            encoding="utf-8")
    # Held-out instruction prompts: titles and first lines of test poems only.
    prompts = []
    for p in split["test"]:
        if len(prompts) >= 24:
            break
        if p["title"] and p["title"] not in {q.get("title") for q in prompts}:
            kind = KIND[(p["n"], p["k"])]
            prompts.append({"title": p["title"], "prompt": [f"写一首关于{p['title']}的诗",
                                                            f"以《{p['title']}》为题写一首{kind}",
                                                            f"续写：{p['couplets'][0]}"][len(prompts) % 3]})
    (work / "heldout_prompts.json").write_text(json.dumps(prompts, ensure_ascii=False, indent=1), encoding="utf-8")
    meta = {"source": "npm chinese-poetry 2.0.1, dist/quantangshi/poet.{tang,song}.*.json", "license": "MIT",
            "conversion": converted, "filter": "regular 五言/七言 绝句/律诗 (4 or 8 lines of 5 or 7 Han chars), "
            "deduplicated by text", "seed": SEED, "train_poems": len(split["train"]), "test_poems": len(split["test"]),
            "by_kind": {KIND[k]: sum(1 for p in poems if (p["n"], p["k"]) == k) for k in KIND}}
    (work / "data_meta.json").write_text(json.dumps(meta, ensure_ascii=False, indent=1), encoding="utf-8")
    print(json.dumps(meta, ensure_ascii=False))


def conversation(p: dict, rng: random.Random) -> tuple[str, str]:
    """(user instruction, assistant reply) for one poem."""
    kind = KIND[(p["n"], p["k"])]
    poem = "".join(p["couplets"])
    t = p["title"]
    r = rng.random()
    if t and r < 0.35:
        return f"写一首关于{t}的诗", poem
    if t and r < 0.65:
        return f"以《{t}》为题写一首{kind}", poem
    if r < 0.8:
        return f"续写：{p['couplets'][0]}", "".join(p["couplets"][1:])
    if r < 0.9:
        return f"写一首{kind}", poem
    if p["author"] and t:
        return f"仿{p['author']}的风格，以《{t}》为题写一首诗", poem
    return f"写一首{kind}", poem


# ------------------------------------------------------------------------------------ tokenizer

def cmd_tokenizer(a) -> None:
    """A SentencePiece BPE on the training split's turns, with ChatGLM3's tokenizer.model settings
    (glmcore.tokenizer.train_sentencepiece); ChatGLM3's special tokens follow its pieces."""
    import sentencepiece as spm

    from glmcore.tokenizer import train_sentencepiece
    work = Path(a.work)
    rng = random.Random(SEED)
    lines = []
    for ln in open(work / "train.jsonl", encoding="utf-8"):
        lines += conversation(json.loads(ln), rng)
    (work / "tokenizer.model").write_bytes(train_sentencepiece(N_PIECES, lines=lines, n_chars=N_CHARS))
    sp = spm.SentencePieceProcessor(model_file=str(work / "tokenizer.model"))
    print(f"tokenizer: {sp.get_piece_size()} pieces; example:",
          sp.encode("床前明月光，疑是地上霜。", out_type=str))


def tokenizer_and_format(work: Path):
    from glmcore.chat import chat_format_for
    from glmcore.tokenizer import SentencePieceTokenizer
    tok = SentencePieceTokenizer(work / "tokenizer.model", "chatglm3")
    return tok, chat_format_for(tok)


def encode_sample(fmt, turns: list[tuple[str, str]]) -> tuple[list[int], list[int]]:
    """ids and loss mask (1 on assistant tokens and each reply's stop token) of a conversation, in
    glmcore's ChatGLM3 chat format: the prompt as encode_messages builds it, each reply as the model
    generates it after <|assistant|> ("\\n" metadata line, the text), ended by <|user|> between turns
    and by </s> at the end."""
    tok = fmt.tok
    ids, mask, msgs = [], [], []
    for i, (q, ans) in enumerate(turns):
        msgs.append({"role": "user", "content": q})
        prompt = fmt.encode_messages(msgs) if i == 0 else fmt.encode_continuation([msgs[-1]], i)
        if i > 0:            # the previous reply ended on <|user|>, which the continuation starts with
            prompt = prompt[1:]
        reply = tok.encode("\n") + tok.encode(ans)
        stop = tok.special_ids["<|user|>"] if i + 1 < len(turns) else tok.eos_id
        ids += prompt + reply + [stop]
        mask += [0] * len(prompt) + [1] * (len(reply) + 1)
        msgs.append({"role": "assistant", "content": ans})
    return ids, mask


def build_samples(work: Path, split: str, epoch_seed: int, fmt) -> list[tuple[list[int], list[int]]]:
    rng = random.Random(epoch_seed)
    poems = [json.loads(ln) for ln in open(work / f"{split}.jsonl", encoding="utf-8")]
    rng.shuffle(poems)
    out, i = [], 0
    while i < len(poems):
        n = 2 if rng.random() < 0.15 and i + 1 < len(poems) else 1     # some two-turn chats
        turns = [conversation(p, rng) for p in poems[i:i + n]]
        i += n
        ids, mask = encode_sample(fmt, turns)
        if len(ids) <= SEQ_LEN:
            out.append((ids, mask))
    return out


def pack(samples, seq_len: int):
    """Greedy packing into rows of seq_len: (ids, targets, loss mask, positions, doc ids). Each
    conversation restarts at position 0 and attends only to itself (as at inference)."""
    import torch
    rows, cur = [], []
    for s in samples:
        if sum(len(x[0]) for x in cur) + len(s[0]) > seq_len:
            rows.append(cur)
            cur = []
        cur.append(s)
    if cur:
        rows.append(cur)
    n = len(rows)
    ids = torch.zeros(n, seq_len, dtype=torch.long)
    tgt = torch.zeros(n, seq_len, dtype=torch.long)
    msk = torch.zeros(n, seq_len)
    pos = torch.zeros(n, seq_len, dtype=torch.long)
    doc = torch.full((n, seq_len), -1, dtype=torch.long)
    for r, row in enumerate(rows):
        o = 0
        for d, (x, m) in enumerate(row):
            T = len(x)
            ids[r, o:o + T] = torch.tensor(x)
            tgt[r, o:o + T - 1] = torch.tensor(x[1:])
            msk[r, o:o + T - 1] = torch.tensor(m[1:], dtype=torch.float32)
            pos[r, o:o + T] = torch.arange(T)
            doc[r, o:o + T] = d
            o += T
    return ids, tgt, msk, pos, doc


# -------------------------------------------------------------------------------------- model

def model_config(n_vocab: int) -> dict:
    from glmcore.arch.glm import CHATGLM_KEYS, FAMILY_KEYS
    padded = -(-n_vocab // 64) * 64
    raw = {"_name_or_path": "glmcore/demo-chatglm3-poet", **CHATGLM_KEYS, **ARCH, **FAMILY_KEYS["chatglm3"],
           "padded_vocab_size": padded}
    raw["seq_length"] = SEQ_LEN * 8
    raw["torch_dtype"] = "bfloat16"
    return raw


def init_params(cfg, seed: int):
    import torch
    from glmcore.weights import canonical_shapes
    g = torch.Generator().manual_seed(seed)
    params = {}
    for name, shape in canonical_shapes(cfg).items():
        if name.endswith("norm.weight"):
            t = torch.ones(shape)
        elif name.endswith(".bias"):
            t = torch.zeros(shape)
        else:
            std = 0.02
            if name.endswith(("attn_out.weight", "ffn_down.weight")):
                std = 0.02 / math.sqrt(2 * cfg.num_layers)
            t = torch.randn(shape, generator=g) * std
        params[name] = torch.nn.Parameter(t)
    return params


def forward(cfg, w, ids, pos, doc=None, hidden: bool = False):
    """Logits [B, T, vocab] of a batch: the torch reference's math (rms_norm, rotary_tables,
    apply_rotary, grouped-query attention, SwiGLU) with a causal mask within each document. hidden: also
    the final hidden states after the final norm (what the NextN layer drafts from)."""
    from plugins.torch_ref.ops import torch_rms_norm as rms_norm
    x = w["embed.weight"][ids]
    rope = rope_and_mask(cfg, pos, doc)
    for i in range(cfg.num_layers):
        x = block(cfg, w, f"layers.{i}.", x, *rope)
    h = rms_norm(x, w["final_norm.weight"], cfg.norm_eps)
    logits = h @ w["lm_head.weight"].T
    return (logits, h) if hidden else logits


def rope_and_mask(cfg, pos, doc):
    """The rotary rows of positions [B, T] and the causal mask within each document [B, T, T]."""
    import torch
    from plugins.torch_ref.model import rotary_tables
    B, T = pos.shape
    cos, sin = rotary_tables(cfg, pos.reshape(-1))
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    mask = causal[None] if doc is None else causal[None] & (doc[:, :, None] == doc[:, None, :])
    return cos.view(B * T, -1), sin.view(B * T, -1), mask


def block(cfg, w, p: str, x, cos, sin, mask):
    """One ChatGLM3 block (weights w[p + ...]) on the residual stream x [B, T, hidden]."""
    import torch.nn.functional as F
    from plugins.torch_ref.model import apply_rotary
    from plugins.torch_ref.ops import torch_rms_norm as rms_norm
    B, T, _ = x.shape
    group = cfg.num_heads // cfg.num_kv_heads
    h = rms_norm(x, w[p + "input_norm.weight"], cfg.norm_eps)
    qkv = h @ w[p + "qkv.weight"].T + w[p + "qkv.bias"]
    q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
    q = apply_rotary(q.reshape(B * T, cfg.num_heads, cfg.head_dim), cos, sin).view(B, T, cfg.num_heads, -1)
    k = apply_rotary(k.reshape(B * T, cfg.num_kv_heads, cfg.head_dim), cos, sin).view(B, T, cfg.num_kv_heads, -1)
    v = v.reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       attn_mask=mask[:, None])
    x = x + a.transpose(1, 2).reshape(B, T, cfg.q_size) @ w[p + "attn_out.weight"].T
    h = rms_norm(x, w[p + "post_attn_norm.weight"], cfg.norm_eps)
    gate, up = (h @ w[p + "ffn_up.weight"].T).chunk(2, dim=-1)
    x = x + (F.silu(gate) * up) @ w[p + "ffn_down.weight"].T
    return x


def nextn_forward(cfg, w, m, ids, pos, doc, hidden):
    """Logits [B, T, vocab] of the NextN layer m (canonical names mtp.0.*) as the torch reference runs it
    (DenseGLM.nextn): at position p it takes the next token ids[p + 1] (its embedding zeroed at position 0)
    and the target's final hidden state hidden[p], eh_proj(concat(enorm(e), hnorm(h))) -> one block -> its own
    final norm -> the model's lm_head; it predicts the token at p + 2. The last position of a row has no next
    token: it gets id 0 (its output is never used)."""
    import torch
    from plugins.torch_ref.ops import torch_rms_norm as rms_norm
    nxt = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)
    e = w["embed.weight"][nxt].masked_fill((pos == 0)[..., None], 0.0)
    joined = torch.cat([rms_norm(e, m["mtp.0.enorm.weight"], cfg.norm_eps),
                        rms_norm(hidden, m["mtp.0.hnorm.weight"], cfg.norm_eps)], dim=-1)
    x = block(cfg, m, "mtp.0.layer.", joined @ m["mtp.0.eh_proj.weight"].T, *rope_and_mask(cfg, pos, doc))
    return rms_norm(x, m["mtp.0.final_norm.weight"], cfg.norm_eps) @ w["lm_head.weight"].T


def load_cfg(work: Path):
    from glmcore.config import ModelConfig
    raw = json.loads((work / "config.json").read_text())
    ckdir = work / "cfgdir"
    ckdir.mkdir(exist_ok=True)
    (ckdir / "config.json").write_text(json.dumps(raw))
    return ModelConfig.from_dir(ckdir)


def masked_loss(cfg, w, batch, autocast: bool):
    import torch
    import torch.nn.functional as F
    ids, tgt, msk, pos, doc = batch
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = forward(cfg, w, ids, pos, doc)
    nll = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tgt.reshape(-1), reduction="none")
    m = msk.reshape(-1)
    return (nll * m).sum() / m.sum(), m.sum()


def heldout_nll(cfg, w, rows, autocast=False, bs=16) -> float:
    import torch
    tot, n = 0.0, 0.0
    with torch.no_grad():
        for s in range(0, rows[0].shape[0], bs):
            batch = [t[s:s + bs] for t in rows]
            loss, cnt = masked_loss(cfg, w, batch, autocast)
            tot += float(loss) * float(cnt)
            n += float(cnt)
    return tot / n


def cmd_train(a) -> None:
    import torch
    torch.manual_seed(SEED)
    torch.set_num_threads(a.threads)
    work = Path(a.work)
    tok, fmt = tokenizer_and_format(work)
    raw = model_config(tok.n_vocab)
    (work / "config.json").write_text(json.dumps(raw, indent=2, ensure_ascii=False) + "\n")
    cfg = load_cfg(work)
    test_rows = pack(build_samples(work, "test", SEED + 999, fmt)[:a.eval_samples], SEQ_LEN)
    ckpt = work / "ckpt.pt"
    w = init_params(cfg, SEED)
    opt = torch.optim.AdamW(list(w.values()), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)
    state = {"step": 0, "epoch": 0, "row": 0, "log": [], "elapsed": 0.0, "tokens": 0}
    if ckpt.exists() and not a.fresh:
        saved = torch.load(ckpt)
        for k in w:
            w[k].data.copy_(saved["w"][k])
        opt.load_state_dict(saved["opt"])
        state = saved["state"]
        print(f"resumed at step {state['step']}", flush=True)
    hp = {"lr": a.lr, "warmup": a.warmup, "batch_rows": a.batch, "seq_len": SEQ_LEN, "minutes": a.minutes,
          "threads": a.threads, "autocast_bf16": a.bf16, "weight_decay": 0.1, "betas": [0.9, 0.95], "seed": SEED,
          "grad_clip": 1.0, "arch": ARCH, "n_vocab": tok.n_vocab, "schedule": "linear warmup, cosine to 10% over "
          "the planned steps (planned = minutes x measured steps/min, re-estimated each log)"}
    (work / "hparams.json").write_text(json.dumps(hp, indent=1))
    t0 = time.time() - state["elapsed"]
    rows = pack(build_samples(work, "train", SEED + state["epoch"], fmt), SEQ_LEN)
    n_rows = rows[0].shape[0]
    last_save = time.time()
    planned = None
    run = 0.0
    while True:
        if state["row"] + a.batch > n_rows:
            state["epoch"] += 1
            state["row"] = 0
            rows = pack(build_samples(work, "train", SEED + state["epoch"], fmt), SEQ_LEN)
            n_rows = rows[0].shape[0]
        batch = [t[state["row"]:state["row"] + a.batch] for t in rows]
        state["row"] += a.batch
        elapsed = time.time() - t0
        if state["step"] >= 20:
            rate = state["step"] / max(elapsed, 1)
            planned = max(state["step"] + 1, int(rate * a.minutes * 60))
        s = state["step"]
        if s < a.warmup:
            lr = a.lr * (s + 1) / a.warmup
        else:
            frac = min(1.0, (s - a.warmup) / max(1, (planned or 10 ** 6) - a.warmup))
            lr = a.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        loss, _ = masked_loss(cfg, w, batch, a.bf16)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(w.values()), 1.0)
        opt.step()
        state["step"] += 1
        state["tokens"] += int(batch[0].numel())
        run = float(loss) if s == 0 else 0.95 * run + 0.05 * float(loss)
        done = elapsed >= a.minutes * 60
        if state["step"] % a.log_every == 0 or done:
            ev = heldout_nll(cfg, w, test_rows, a.bf16) if state["step"] % (a.log_every * 5) == 0 or done else None
            rec = {"step": state["step"], "min": round(elapsed / 60, 2), "tokens": state["tokens"], "lr": lr,
                   "train_loss": round(run, 4), "heldout_loss": None if ev is None else round(ev, 4)}
            state["log"].append(rec)
            print(json.dumps(rec), flush=True)
        if time.time() - last_save > a.save_minutes * 60 or done:
            state["elapsed"] = time.time() - t0
            tmp = work / "ckpt.pt.tmp"
            torch.save({"w": {k: v.detach() for k, v in w.items()}, "opt": opt.state_dict(), "state": state}, tmp)
            tmp.replace(ckpt)
            (work / "log.json").write_text(json.dumps(state["log"]))
            last_save = time.time()
        if done:
            break
    print("done", flush=True)


# ------------------------------------------------------------------------------------- export

def cmd_export(a) -> None:
    import numpy as np
    import torch
    from glmcore.arch.glm import chatglm_name
    from glmcore.weights import BF16, write_safetensors
    work, out = Path(a.work), Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    saved = torch.load(work / "ckpt.pt")
    raw = json.loads((work / "config.json").read_text())
    raw["glmcore_demo"] = {"trained_steps": saved["state"]["step"], "corpus": "chinese-poetry (MIT)",
                           "script": "tools/train_demo.py"}
    (out / "config.json").write_text(json.dumps(raw, indent=2, ensure_ascii=False) + "\n")
    tensors = {chatglm_name(k): v.float().numpy().astype(BF16) for k, v in saved["w"].items()}
    write_safetensors(out / "model.safetensors", tensors, {"format": "pt"})
    (out / "tokenizer.model").write_bytes((work / "tokenizer.model").read_bytes())
    from glmcore.tokenizer import _write_config
    _write_config(out, "chatglm3", 0, name="glmcore/demo-chatglm3-poet")
    (out / "training_log.json").write_text(json.dumps({"hparams": json.loads((work / "hparams.json").read_text()),
                                                       "data": json.loads((work / "data_meta.json").read_text()),
                                                       "log": saved["state"]["log"]}, ensure_ascii=False, indent=1))
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"wrote {out}: {size / 2**20:.2f} MiB")
    np.asarray(0)


def cmd_mtp(a) -> None:
    """Train a NextN (multi-token-prediction) layer for the exported model in --model, its own weights frozen,
    and write it there as mtp.safetensors (config.json gets num_nextn_predict_layers 1). The layer learns the
    model's own next-but-one distribution (soft targets: the model's softmax at p + 1 for the NextN output at p,
    on the replies), which is what greedy speculative acceptance rewards. Init: the block is a copy of the
    model's last block, eh_proj passes the hidden state through, the head's norm is the model's final norm."""
    import numpy as np
    import torch
    import torch.nn.functional as F
    from glmcore.arch.glm import chatglm_name, mtp_as_layer
    from glmcore.config import ModelConfig
    from glmcore.weights import BF16, load_weights, write_safetensors
    torch.manual_seed(SEED)
    torch.set_num_threads(a.threads)
    work, model = Path(a.work), Path(a.model)
    cfg = ModelConfig.from_dir(model)
    if cfg.num_mtp_layers:
        raise SystemExit(f"{model} has a NextN layer already (num_nextn_predict_layers); export the model again")
    base = load_weights(model, cfg)
    w = {k: torch.from_numpy(np.ascontiguousarray(base.f32(k))) for k in base}
    _, fmt = tokenizer_and_format(model)
    h = cfg.hidden_size
    last = f"layers.{cfg.num_layers - 1}."
    m = {"mtp.0.enorm.weight": torch.ones(h), "mtp.0.hnorm.weight": torch.ones(h),
         "mtp.0.eh_proj.weight": torch.cat([torch.randn(h, h) * 0.02, torch.eye(h)], dim=1),
         "mtp.0.final_norm.weight": w["final_norm.weight"].clone(),
         **{"mtp.0.layer." + k[len(last):]: v.clone() for k, v in w.items() if k.startswith(last)}}
    m = {k: torch.nn.Parameter(v) for k, v in m.items()}
    opt = torch.optim.AdamW(list(m.values()), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.0)

    def loss_of(batch):
        ids, _, msk, pos, doc = batch
        with torch.no_grad():
            logits, hidden = forward(cfg, w, ids, pos, doc, hidden=True)
            teacher = F.softmax(logits[:, 1:], dim=-1)              # the model at p + 1: the token at p + 2
            greedy = logits[:, 1:].argmax(-1)
        out = nextn_forward(cfg, w, m, ids, pos, doc, hidden)[:, :-1]
        mask = msk[:, 1:]                                            # a reply's token at p + 2 (same document)
        soft = -(teacher * F.log_softmax(out, dim=-1)).sum(-1)
        agree = (out.argmax(-1) == greedy).float()
        return (soft * mask).sum() / mask.sum(), (agree * mask).sum() / mask.sum()

    test = pack(build_samples(work, "test", SEED + 999, fmt)[:a.eval_samples], SEQ_LEN)
    rows = pack(build_samples(work, "train", SEED + 7, fmt), SEQ_LEN)
    log, t0, step, row = [], time.time(), 0, 0
    while time.time() - t0 < a.minutes * 60 and row + a.batch <= rows[0].shape[0]:
        frac = (time.time() - t0) / (a.minutes * 60)
        lr = a.lr * min(1.0, (step + 1) / a.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        loss, agree = loss_of([t[row:row + a.batch] for t in rows])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(m.values()), 1.0)
        opt.step()
        step, row = step + 1, row + a.batch
        if step % a.log_every == 0:
            rec = {"step": step, "min": round((time.time() - t0) / 60, 2), "lr": lr, "loss": round(float(loss.detach()), 4),
                   "agree_with_greedy": round(float(agree), 4)}
            log.append(rec)
            print(json.dumps(rec), flush=True)
    with torch.no_grad():
        held = [loss_of([t[s:s + 16] for t in test]) for s in range(0, test[0].shape[0], 16)]
    result = {"steps": step, "minutes": round((time.time() - t0) / 60, 1), "threads": a.threads,
              "heldout_soft_loss": round(float(sum(x[0] for x in held) / len(held)), 4),
              "heldout_agree_with_greedy": round(float(sum(x[1] for x in held) / len(held)), 4)}
    print(json.dumps(result), flush=True)
    names = lambda k: chatglm_name(mtp_as_layer(k, cfg))         # noqa: E731  (layer num_layers in the ChatGLM layout)
    write_safetensors(model / "mtp.safetensors", {names(k): v.detach().numpy().astype(BF16) for k, v in m.items()},
                      {"format": "pt"})
    raw = json.loads((model / "config.json").read_text())
    raw["num_nextn_predict_layers"] = 1
    raw.setdefault("glmcore_demo", {})["mtp"] = {**result, "file": "mtp.safetensors", "script": "tools/train_demo.py mtp"}
    (model / "config.json").write_text(json.dumps(raw, indent=2, ensure_ascii=False) + "\n")
    (work / "mtp_log.json").write_text(json.dumps({"log": log, "result": result}, indent=1))
    print(f"wrote {model / 'mtp.safetensors'}")


def cmd_plot(a) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    log = json.loads(Path(a.log).read_text())["log"]
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=100)
    ax.plot([r["min"] for r in log], [r["train_loss"] for r in log], label="train (EMA)")
    ev = [r for r in log if r["heldout_loss"] is not None]
    ax.plot([r["min"] for r in ev], [r["heldout_loss"] for r in ev], "o-", label="held-out")
    ax.set_xlabel("minutes (1 CPU thread)")
    ax.set_ylabel("loss (nats/token, replies)")
    ax.set_title("demo-chatglm3-poet training")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(a.out)
    print(f"wrote {a.out}")


def cmd_bench(a) -> None:
    """Steps per second of the training step at a given thread count / autocast (to choose them)."""
    import torch
    torch.set_num_threads(a.threads)
    work = Path(a.work)
    tok, fmt = tokenizer_and_format(work)
    (work / "config.json").write_text(json.dumps(model_config(tok.n_vocab), indent=2))
    cfg = load_cfg(work)
    rows = pack(build_samples(work, "test", 1, fmt), SEQ_LEN)
    w = init_params(cfg, 0)
    opt = torch.optim.AdamW(list(w.values()), lr=1e-3)
    t = None
    for s in range(a.steps + 2):
        if s == 2:
            t = time.time()
        batch = [x[s * a.batch:(s + 1) * a.batch] for x in rows]
        loss, _ = masked_loss(cfg, w, batch, a.bf16)
        opt.zero_grad()
        loss.backward()
        opt.step()
    dt = (time.time() - t) / a.steps
    print(f"threads={a.threads} bf16={a.bf16} batch={a.batch}: {dt:.3f} s/step, "
          f"{a.batch * SEQ_LEN / dt:.0f} tokens/s, loss {float(loss):.3f}")


# ------------------------------------------------------------------------------------ measure

def line_lengths(text: str) -> list[int]:
    """Han characters per line of a reply, lines split at ，。！？ (empty pieces dropped)."""
    return [n for n in (len(HAN.findall(x)) for x in LINE_SPLIT.split(text)) if n]


def generate(batch, fmt, prompt: str, params, max_new: int = 120) -> str:
    """One reply: the chat prompt, then tokens drawn by glmcore's Sampler until a stop id."""
    from glmcore.sampling import Sampler
    sampler = Sampler(params, n_vocab=fmt.tok.n_vocab)
    batch.reset(0)
    ids = fmt.encode_messages([{"role": "user", "content": prompt}])
    logits = batch.step([(0, ids)])[0]
    out = []
    for _ in range(max_new):
        t = sampler(logits, ids + out)
        if t in fmt.stop_ids:
            break
        out.append(t)
        logits = batch.step([(0, [t])])[0]
    return fmt.decode_reply(out).content


def cmd_measure(a) -> None:
    """The done-when figures: held-out perplexity (f32) vs a unigram model under the same tokenizer,
    and the share of 5/7-Han-character lines in replies to the held-out prompts."""
    import dataclasses

    import numpy as np
    import torch
    from glmcore.backend import LoadOptions, registry
    from glmcore.chat import chat_format_for
    from glmcore.config import ModelConfig
    from glmcore.sampling import SamplingParams
    from glmcore.tokenizer import load_tokenizer
    from glmcore.weights import load_weights
    torch.set_num_threads(a.threads)
    work, model = Path(a.work), Path(a.model)
    cfg = ModelConfig.from_dir(model)
    tok = load_tokenizer(model, "chatglm3")
    fmt = chat_format_for(tok)
    weights = load_weights(model, cfg)
    w = {k: torch.from_numpy(np.array(weights[k], dtype=np.float32)) for k in weights}
    res = {"model": str(model)}
    # Unigram model of reply tokens (targets under the loss mask) from the training split, add-one.
    counts = np.ones(cfg.vocab_size)
    for ids, mask in build_samples(work, "train", SEED, fmt)[:a.limit]:
        t = np.array(ids[1:])[np.array(mask[1:]) == 1]
        np.add.at(counts, t, 1)
    counts = counts[:tok.n_vocab]            # padding rows of the output layer are never targets
    logp = np.log(counts / counts.sum())
    test = build_samples(work, "test", SEED + 999, fmt)[:a.limit]
    rows = pack(test, SEQ_LEN)
    m = rows[2].reshape(-1) == 1
    uni = -logp[rows[1].reshape(-1)[m].numpy()].mean()
    nll = heldout_nll(cfg, w, rows, autocast=False)
    # Standard error of the mean NLL over conversations (each is one independent sample).
    per = []
    with torch.no_grad():
        for s in range(0, rows[0].shape[0], 16):
            batch = [t[s:s + 16] for t in rows]
            logits = forward(cfg, w, batch[0], batch[3], batch[4]).float()
            lp = torch.log_softmax(logits, -1).gather(-1, batch[1][..., None])[..., 0]
            for r in range(lp.shape[0]):
                for d in batch[4][r].unique().tolist():
                    if d < 0:
                        continue
                    sel = (batch[4][r] == d) & (batch[2][r] == 1)
                    per.append((-lp[r][sel]).sum().item() / max(1, int(sel.sum())))
    se = float(np.std(per) / np.sqrt(len(per)))
    res.update(heldout_conversations=len(test), heldout_tokens=int(m.sum()), nll=nll, ppl=math.exp(nll),
               ppl_range=[math.exp(nll - 2 * se), math.exp(nll + 2 * se)], unigram_ppl=float(math.exp(uni)),
               ratio=math.exp(nll) / math.exp(uni))
    print(json.dumps({k: res[k] for k in ("ppl", "unigram_ppl", "ratio")}), flush=True)
    prompts = [p["prompt"] for p in json.loads((work / "heldout_prompts.json").read_text(encoding="utf-8"))]
    prompts = prompts[:a.limit]
    reg = registry()
    b = reg.get(a.backend)
    batch = b.load_batch(cfg, weights, b.resolve(LoadOptions(threads=a.threads)), 1)
    for name, params in (("greedy", SamplingParams(temperature=0.0)), ("sampled", SamplingParams(seed=0))):
        replies = [generate(batch, fmt, p, dataclasses.replace(params, seed=i) if name == "sampled"
                            else params) for i, p in enumerate(prompts)]
        lens = [n for r in replies for n in line_lengths(r)]
        res[name] = {"lines": len(lens), "rate_5_7": sum(n in (5, 7) for n in lens) / max(1, len(lens)),
                     "replies": dict(zip(prompts, replies))}
        print(name, json.dumps({k: v for k, v in res[name].items() if k != "replies"}), flush=True)
    Path(a.out).write_text(json.dumps(res, ensure_ascii=False, indent=1), encoding="utf-8")
    print(f"wrote {a.out}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("data")
    d.add_argument("--src", required=True, help="chinese-poetry's dist/ folder")
    d.add_argument("--work", required=True)
    t = sub.add_parser("tokenizer")
    t.add_argument("--work", required=True)
    for name in ("train", "bench"):
        p = sub.add_parser(name)
        p.add_argument("--work", required=True)
        p.add_argument("--threads", type=int, default=1)
        p.add_argument("--batch", type=int, default=16)
        p.add_argument("--bf16", action="store_true", help="bf16 autocast for the matmuls")
        if name == "train":
            p.add_argument("--minutes", type=float, default=70)
            p.add_argument("--lr", type=float, default=3e-3)
            p.add_argument("--warmup", type=int, default=100)
            p.add_argument("--log-every", type=int, default=20)
            p.add_argument("--save-minutes", type=float, default=4)
            p.add_argument("--eval-samples", type=int, default=400)
            p.add_argument("--fresh", action="store_true")
        else:
            p.add_argument("--steps", type=int, default=10)
    e = sub.add_parser("export")
    e.add_argument("--work", required=True)
    e.add_argument("--out", required=True)
    pl = sub.add_parser("plot")
    pl.add_argument("--log", required=True, help="training_log.json")
    pl.add_argument("--out", required=True)
    mt = sub.add_parser("mtp", help="train a NextN layer for an exported model (speculative decoding)")
    mt.add_argument("--work", required=True)
    mt.add_argument("--model", required=True, help="the exported model folder (gets mtp.safetensors)")
    mt.add_argument("--minutes", type=float, default=20)
    mt.add_argument("--threads", type=int, default=1)
    mt.add_argument("--batch", type=int, default=16)
    mt.add_argument("--lr", type=float, default=1e-3)
    mt.add_argument("--warmup", type=int, default=50)
    mt.add_argument("--log-every", type=int, default=20)
    mt.add_argument("--eval-samples", type=int, default=400)
    ms = sub.add_parser("measure")
    ms.add_argument("--work", required=True)
    ms.add_argument("--model", required=True, help="the exported model folder")
    ms.add_argument("--backend", default="torch")
    ms.add_argument("--threads", type=int, default=1)
    ms.add_argument("--out", required=True, help="results JSON")
    ms.add_argument("--limit", type=int, default=None, help="first N samples/prompts only (a quick check)")
    a = ap.parse_args(argv)
    {"data": cmd_data, "tokenizer": cmd_tokenizer, "train": cmd_train, "export": cmd_export, "plot": cmd_plot,
     "bench": cmd_bench, "measure": cmd_measure, "mtp": cmd_mtp}[a.cmd](a)


if __name__ == "__main__":
    main()
