"""Writes glmcore/data/calibration.txt, the text `quant=awq` calibrates on when the user gives none.

Calibration wants text like what the model will see. The built-in model's training poems are not shipped
(and its held-out poems, tests/data/demo_heldout_poems.txt, must stay unseen: they are what `glmcore eval`
measures), so the sample's first part is the model's own output: the f32 reference (torch) writing poems
on generic topics (none of them a held-out title), sampled at temperature 1 with a fixed seed -- the model's
own distribution, as data-free quantization methods do. Then the English prose of glmcore/data/corpus.txt,
so a real checkpoint calibrated on the default sample also sees plain prose.

    python tools/make_calibration.py [--out glmcore/data/calibration.txt]
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOPICS = ("春雨 秋风 明月 江南 山居 边塞 送别 思乡 梅花 柳枝 落日 孤舟 夜泊 登高 渔父 田家 雪夜 清明 重阳 "
          "中秋 寒食 长江 黄河 西湖 庐山 洞庭 古寺 松风 竹林 荷花 菊花 桃花 杏花 牡丹 芳草 流水 白云 "
          "晚霞 晨钟 暮鼓 羁旅 怀古 闺怨 春晓 夏日 秋夕 冬夜 除夕 元宵 江楼 山行 野望 幽居 闲居 归田 "
          "塞下 出塞 从军 离别 故人 友人 老僧 隐士 樵夫 牧童 燕子 鸿雁 杜鹃 黄鹂 孤雁 寒鸦 春江 秋江 "
          "夜雨 晴川 烟波 石桥 小楼 庭院 书斋 酒家 茶 琴 棋 剑 笛 灯 月夜 星河 风雪 残春 新秋").split()
TEMPLATES = ("写一首关于{t}的诗", "以《{t}》为题写一首五言绝句", "以《{t}》为题写一首七言绝句",
             "以《{t}》为题写一首五言律诗", "以《{t}》为题写一首七言律诗")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "glmcore" / "data" / "calibration.txt"))
    ap.add_argument("--seed", type=int, default=20261127)
    a = ap.parse_args()
    held = {p["title"] for p in json.loads((ROOT / "tests/data/demo_heldout_prompts.json").read_text("utf-8"))}
    prompts = [tpl.format(t=t) for t in TOPICS if t not in held for tpl in TEMPLATES]
    with tempfile.NamedTemporaryFile("w", suffix=".txt", encoding="utf-8", delete=False) as f:
        f.write("\n".join(prompts) + "\n")
    out = subprocess.run([sys.executable, "-m", "glmcore.cli", "run", "--backend", "torch", "--prompts", f.name,
                          "--seed", str(a.seed), "--temperature", "1.0", "--max-new-tokens", "120",
                          "--threads", "2"], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    Path(f.name).unlink()
    # replies come as "--- [i] prompt" then the reply's lines; keep each reply as one line of poem
    poems = [re.sub(r"\s+", "", block.split("\n", 1)[1]) for block in out.split("--- [")[1:] if "\n" in block]
    poems = [p for p in poems if p]
    prose = (ROOT / "glmcore" / "data" / "corpus.txt").read_text("utf-8")
    Path(a.out).write_text("\n".join(poems) + "\n" + prose, encoding="utf-8")
    print(f"{a.out}: {len(poems)} poems from {len(prompts)} prompts, then corpus.txt's prose")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
