#!/usr/bin/env python3
"""Build the offline training corpus for the trained target (issue 15) and its tokenizer.

The corpus is text that Debian packages ship on the development machine (Python, C/C++ headers,
Perl, shell scripts) plus the King James Bible that trained the embedded tiny-k3 model. No network:
everything is read from installed files (and Debian's `bible` command, package `bible-kjv`).

What it does, deterministically for the same installed files:
  1. scan the sources below (sorted paths), keep UTF-8 text files that a Debian package owns
     (dpkg's file lists), drop binary / huge / minified / data-table files, and exact duplicates (by content, first path in sorted order wins);
  2. cap each source's bytes by a deterministic content-hash order, so the artifact stays small
     enough to travel with the repository to the GPU machine (about 20 MB compressed);
  3. split train / held-out BY FILE: a file is held out iff sha256(content) mod 1000 < 1000 ×
     --heldout (default 3 %);
  4. write OUT/train.txt.xz and OUT/heldout.txt.xz (documents joined by NUL, which no kept file
     contains) and OUT/manifest.json (sources, Debian packages and their licences as declared in
     /usr/share/doc/PKG/copyright, filter counts, sizes, sha256 of the artifacts);
  5. train a byte-level BPE tokenizer (`tokenizers`) on the train split with ferry's special tokens
     and chat template (scripts/make_tiny_k3.py's), write OUT/tokenizer.json and
     OUT/tokenizer_config.json, and count the tokens of both splits into the manifest.

    python3 scripts/make_corpus.py                       # -> corpus/ (git-ignored)
    python3 scripts/make_corpus.py --max-mb 4 --out /tmp/c   # a small corpus for a smoke test

Read the documents back with `read_docs(path)`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

DEFAULT_OUT = ROOT / "corpus"
SEP = "\0"

# name, root globs, file selector (see `selects`), a general description of the licences.
SOURCES = [
    ("python-stdlib", ["/usr/lib/python3.*"], "py",
     "Python standard library (libpython3.x-stdlib): PSF License"),
    ("python-dist-packages", ["/usr/lib/python3/dist-packages"], "py",
     "Debian's Python packages: free licences (MIT, BSD, Apache-2.0, LGPL/GPL, PSF) per package"),
    ("c-headers", ["/usr/include"], "c",
     "C/C++ headers of -dev packages: glibc (LGPL-2.1+), Linux UAPI (GPL-2.0 WITH syscall note), "
     "libstdc++ (GPL-3.0 WITH GCC runtime exception), LLVM (Apache-2.0 WITH LLVM exception), "
     "Node.js/V8/OpenSSL/ICU (MIT, BSD, Apache-2.0, ICU) and others, per package"),
    ("perl", ["/usr/share/perl", "/usr/share/perl5", "/usr/lib/x86_64-linux-gnu/perl",
              "/usr/lib/x86_64-linux-gnu/perl5", "/usr/lib/x86_64-linux-gnu/perl-base"], "perl",
     "Perl core and CPAN modules: Artistic-1.0 or GPL-1.0+ (Perl's terms), some per package"),
    ("shell", ["/usr/bin", "/usr/sbin", "/usr/lib", "/usr/libexec", "/usr/share", "/etc"], "sh",
     "shell scripts shipped by packages: mostly GPL-2.0+/GPL-3.0+, some MIT/BSD, per package"),
]
KJV = ("kjv", "King James Bible (Debian bible-kjv): public domain text (Crown copyright in the UK)")

C_EXT = {".h", ".hh", ".hpp", ".hxx", ".h++", ".tcc", ".inl", ".ipp"}
PERL_EXT = {".pm", ".pl", ".pod"}
SHEBANG_SH = re.compile(rb"^#![ \t]*\S*/(env[ \t]+)?(sh|bash|dash|ksh|zsh)\b")

MAX_FILE = 512 * 1024  # bytes: larger files are generated tables or amalgamations
MIN_FILE = 64


def selects(kind: str, path: str, head: bytes) -> bool:
    name = os.path.basename(path)
    ext = os.path.splitext(name)[1].lower()
    if kind == "py":
        return ext == ".py"
    if kind == "c":
        # libstdc++'s extensionless standard headers (<vector>, <map>, ...) too.
        return ext in C_EXT or ("/c++/" in path and ext == "" and head[:2] in (b"//", b"/*", b"#p", b"\n/"))
    if kind == "perl":
        return ext in PERL_EXT
    if kind == "sh":
        return ext == ".sh" or bool(SHEBANG_SH.match(head))
    raise ValueError(kind)


def reject_reason(raw: bytes) -> str | None:
    """Why a file is not corpus text, or None."""
    if len(raw) < MIN_FILE:
        return "tiny"
    if len(raw) > MAX_FILE:
        return "huge"
    if b"\0" in raw:
        return "binary"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return "not-utf8"
    lines = text.split("\n")
    if max(len(line) for line in lines) > 2000 or len(text) / max(len(lines), 1) > 160:
        return "minified"
    # Generated data: files that are mostly numbers (hex tables, lookup arrays, Unicode data).
    sample = text[:65536]
    data = sum(c in "0123456789abcdefABCDEFxX,{}() \t\n" for c in sample)
    digits = sum(c.isdigit() for c in sample)
    if data / len(sample) > 0.85 or digits / len(sample) > 0.4:
        return "data-table"
    ctrl = sum(ord(c) < 32 and c not in "\n\t\r\f" for c in sample)
    if ctrl > 0:
        return "control-chars"
    return None


def normalise(raw: bytes) -> str:
    text = raw.decode("utf-8").replace("\r\n", "\n")
    text = "\n".join(line.rstrip() for line in text.split("\n")).strip("\n")
    return text + "\n"


def dpkg_owners() -> dict[str, str]:
    """path -> Debian package, from dpkg's file lists (fast; no dpkg -S per file)."""
    owners = {}
    for lst in sorted(Path("/var/lib/dpkg/info").glob("*.list")):
        pkg = lst.name[: -len(".list")].split(":")[0]
        for line in lst.read_text(errors="replace").splitlines():
            owners.setdefault(line, pkg)
    return owners


def package_licences(pkg: str) -> list[str]:
    """The licence names a package's DEP-5 copyright file declares (first 8)."""
    f = Path("/usr/share/doc") / pkg / "copyright"
    try:
        text = f.read_text(errors="replace")
    except OSError:
        return []
    seen = []
    for m in re.finditer(r"^License:[ \t]*(\S[^\n]*)", text, re.MULTILINE):
        name = m.group(1).strip()
        if name and name not in seen:
            seen.append(name)
    return seen[:8]


def scan_source(kind: str, roots: list[str], claimed: set[str], stats: Counter):
    """Yields (path, raw bytes) of selected files, sorted by path, each real file once."""
    dirs = []
    for pattern in roots:
        if "*" in pattern:
            base = Path(pattern).parent
            dirs += sorted(str(p) for p in base.glob(Path(pattern).name) if p.is_dir())
        elif os.path.isdir(pattern):
            dirs.append(pattern)
    for root in dirs:
        for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
            dirnames.sort()
            if "__pycache__" in dirnames:
                dirnames.remove("__pycache__")
            for fn in sorted(filenames):
                path = os.path.join(dirpath, fn)
                if path in claimed or os.path.islink(path):
                    continue
                try:
                    st = os.stat(path)
                    if not os.path.isfile(path) or st.st_size > 8 * MAX_FILE:
                        continue
                    with open(path, "rb") as fh:
                        head = fh.read(64)
                        if not selects(kind, path, head):
                            continue
                        raw = head + fh.read()
                except OSError:
                    stats["unreadable"] += 1
                    continue
                claimed.add(path)
                yield path, raw


def kjv_books() -> list[tuple[str, str]]:
    """One document per book of the KJV (Debian's `bible` command), one verse per line, as
    scripts/make_tiny_k3.py's corpus stage cleans it."""
    raw = subprocess.run(["bible", "-f", "gen1:1-rev22:21"], check=True, capture_output=True,
                         text=True).stdout
    books: dict[str, list[str]] = {}
    order = []
    for line in raw.splitlines():
        m = re.match(r"^(\S+?)\d+:\d+\s+(.*)$", line)
        if not m:
            continue
        book, text = m.group(1), m.group(2).strip()
        if book not in books:
            books[book] = []
            order.append(book)
        if text:
            books[book].append(text)
    return [(f"kjv/{b}", "\n".join(books[b]) + "\n") for b in order]


def content_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def write_xz(path: Path, docs: list[str]) -> int:
    data = SEP.join(docs).encode("utf-8")
    # Single-threaded preset 9: the same bytes on every machine for the same input.
    with lzma.open(path, "wb", preset=9) as fh:
        fh.write(data)
    return len(data)


def read_docs(path) -> list[str]:
    """The documents of a corpus artifact (`train.txt.xz` / `heldout.txt.xz`)."""
    with lzma.open(path, "rb") as fh:
        return fh.read().decode("utf-8").split(SEP)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def build(args) -> dict:
    t0 = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    owners = dpkg_owners()
    caps = {}
    for item in args.cap:
        name, mb = item.split("=")
        caps[name] = float(mb) * 1e6
    seen_hash: set[str] = set()
    claimed: set[str] = set()
    docs = []  # (source, path, text, hash)
    pkg_of: dict[str, str] = {}
    report = {}
    for name, roots, kind, licence in SOURCES:
        stats: Counter = Counter()
        kept = []
        for path, raw in scan_source(kind, roots, claimed, stats):
            stats["seen"] += 1
            owner = owners.get(os.path.realpath(path), owners.get(path))
            # Only what a Debian package ships (its licence is declared in its copyright file).
            why = reject_reason(raw) if owner else "no-package"
            if why:
                stats[why] += 1
                continue
            text = normalise(raw)
            h = content_hash(text)
            if h in seen_hash:
                stats["duplicate"] += 1
                continue
            seen_hash.add(h)
            kept.append((name, path, text, h))
            pkg_of[path] = owner
        # Per-source cap: keep files in content-hash order until the cap (deterministic, and
        # independent of the paths' order), then restore path order.
        total = sum(len(t) for _, _, t, _ in kept)
        cap = caps.get(name, float("inf")) * args.scale
        if total > cap:
            chosen, size = set(), 0
            for d in sorted(kept, key=lambda d: d[3]):
                if size + len(d[2]) > cap:
                    continue
                chosen.add(d[3])
                size += len(d[2])
            stats["over-cap"] = len(kept) - len(chosen)
            kept = [d for d in kept if d[3] in chosen]
        pkgs = Counter()
        for _, path, text, _ in kept:
            pkgs[pkg_of[path]] += len(text)
        report[name] = {
            "roots": roots,
            "licences_in_general": licence,
            "files": len(kept),
            "bytes": sum(len(t) for _, _, t, _ in kept),
            "filtered": dict(sorted(stats.items())),
            "packages": len(pkgs),
            "top_packages_by_bytes": [
                {"package": p, "bytes": b, "declared_licences": package_licences(p)}
                for p, b in pkgs.most_common(12)
            ],
        }
        docs += kept
        print(f"corpus: {name}: {len(kept)} files, {report[name]['bytes'] / 1e6:.1f} MB "
              f"({dict(stats)})", flush=True)
    if not args.no_kjv:
        name, licence = KJV
        kept = []
        for path, text in kjv_books():
            h = content_hash(text)
            if h not in seen_hash:
                seen_hash.add(h)
                kept.append((name, path, text, h))
        report[name] = {"roots": ["bible -f gen1:1-rev22:21 (package bible-kjv)"],
                        "licences_in_general": licence, "files": len(kept),
                        "bytes": sum(len(t) for _, _, t, _ in kept)}
        docs += kept
        print(f"corpus: kjv: {len(kept)} books, {report[name]['bytes'] / 1e6:.1f} MB", flush=True)

    held = int(args.heldout * 1000)
    train = [d for d in docs if int(d[3][:8], 16) % 1000 >= held]
    heldout = [d for d in docs if int(d[3][:8], 16) % 1000 < held]
    sizes = {}
    for split, part in (("train", train), ("heldout", heldout)):
        f = out / f"{split}.txt.xz"
        raw = write_xz(f, [t for _, _, t, _ in part])
        sizes[split] = {
            "files": len(part),
            "bytes": raw,
            "xz_bytes": f.stat().st_size,
            "sha256_xz": sha256_file(f),
            "by_source": {s: sum(1 for d in part if d[0] == s) for s in report},
        }
        print(f"corpus: {split}: {len(part)} files, {raw / 1e6:.1f} MB -> {f} "
              f"({f.stat().st_size / 1e6:.1f} MB xz)", flush=True)
    manifest = {
        "produced_by": "scripts/make_corpus.py " + " ".join(sys.argv[1:]),
        "format": "xz-compressed UTF-8, documents joined by NUL; read with make_corpus.read_docs",
        "heldout_rule": f"sha256(normalised content) first 8 hex digits mod 1000 < {held}",
        "filters": {"min_bytes": MIN_FILE, "max_bytes": MAX_FILE,
                    "dropped": "NUL bytes, not UTF-8, lines > 2000 chars or mean > 160 (minified), "
                               "mostly digits/hex (data tables), control characters, exact "
                               "duplicates after normalising line ends and trailing blanks"},
        "caps_mb": {k: v / 1e6 * args.scale for k, v in caps.items()},
        "sources": report,
        "splits": sizes,
        "python": sys.version.split()[0],
        "seconds": round(time.time() - t0, 1),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def train_tokenizer(args, manifest: dict) -> None:
    """Byte-level BPE on (a deterministic subset of) the train split, then token counts."""
    import make_tiny_k3 as k3
    from tokenizers import Tokenizer

    out = Path(args.out)
    t0 = time.time()
    docs = read_docs(out / "train.txt.xz")
    # Every n-th document, up to --tokenizer-mb: enough text for the merges, bounded time.
    total = sum(len(d) for d in docs)
    step = max(1, int(total / (args.tokenizer_mb * 1e6) + 0.999))
    subset = docs[::step]
    with tempfile.TemporaryDirectory() as tmp:
        f = Path(tmp) / "tok-train.txt"
        f.write_text("\n".join(subset), encoding="utf-8")
        k3.train_bpe_tokenizer([str(f)], args.vocab, out, args.model_max_length)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    counts = {}
    for split in ("train", "heldout"):
        part = docs if split == "train" else read_docs(out / "heldout.txt.xz")
        n = 0
        for i in range(0, len(part), 512):
            n += sum(len(e.ids) for e in tok.encode_batch(part[i : i + 512], add_special_tokens=False))
        counts[split] = n
        b = manifest["splits"][split]["bytes"]
        print(f"tokenizer: {split}: {n:,} tokens ({b / max(n, 1):.2f} bytes/token)", flush=True)
    manifest["tokenizer"] = {
        "vocab_size": args.vocab,
        "trained_on_bytes": sum(len(d) for d in subset),
        "trained_on_files": len(subset),
        "tokens": counts,
        "sha256": sha256_file(out / "tokenizer.json"),
        "seconds": round(time.time() - t0, 1),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default=str(DEFAULT_OUT))
    p.add_argument("--heldout", type=float, default=0.03, help="fraction of files held out")
    p.add_argument("--cap", action="append",
                   default=["python-stdlib=30", "python-dist-packages=30", "c-headers=70",
                            "perl=25", "shell=10"],
                   help="NAME=MB: per-source byte cap (before --scale)")
    p.add_argument("--scale", type=float, default=1.0,
                   help="multiply every cap (e.g. 0.03 for a small smoke-test corpus)")
    p.add_argument("--no-kjv", action="store_true")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--tokenizer-mb", type=float, default=40.0,
                   help="train the BPE on every n-th train document, up to about this many MB")
    p.add_argument("--model-max-length", type=int, default=4096)
    p.add_argument("--no-tokenizer", action="store_true")
    args = p.parse_args()
    manifest = build(args)
    if not args.no_tokenizer:
        train_tokenizer(args, manifest)
    print(f"corpus: manifest -> {Path(args.out) / 'manifest.json'}")


if __name__ == "__main__":
    main()
