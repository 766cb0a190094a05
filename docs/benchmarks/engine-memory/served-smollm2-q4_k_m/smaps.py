"""Resident MB of a running process by kind of mapping, from /proc/PID/smaps and status: one JSON line.

    python smaps.py PID LABEL [MODEL_FILE]

Kinds: the model file's mapping (its privately written part beside), the heap, anonymous mappings of 64
MB or more (the KV pool: Tern's and llama-server's are the only ones), other anonymous memory,
shared libraries (their private pages beside), other files.
"""

import json
import sys
from collections import Counter


def main(pid: str, label: str, model: str) -> None:
    out: dict[str, object] = {"label": label}
    for line in open(f"/proc/{pid}/status"):
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM", "Threads"):
            out[key] = int(value.split()[0]) // (1 if key == "Threads" else 1024)
    kinds: Counter[str] = Counter()
    libraries: Counter[str] = Counter()
    kind = library = ""
    for line in open(f"/proc/{pid}/smaps"):
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's header line
            start, end = (int(x, 16) for x in fields[0].split("-"))
            path = fields[5] if len(fields) > 5 else ""
            library = ""
            if model and path.endswith(model.rsplit("/", 1)[-1]):
                kind = "model_file"
            elif ".so" in path:
                kind, library = "libraries", path.rsplit("/", 1)[-1].split(".so")[0]
            elif path == "[heap]":
                kind = "heap"
            elif not path:
                kind = "big_anon(kv?)" if end - start >= 64 << 20 else "anon"
            else:
                kind = "other:" + path.rsplit("/", 1)[-1][:20]
        elif fields[0] == "Rss:":
            kinds[kind] += int(fields[1])
            if library:
                libraries[library] += int(fields[1])
        elif fields[0] == "Anonymous:" and kind in ("model_file", "libraries"):
            kinds[kind + "_private"] += int(fields[1])
    out.update({k: round(v / 1024, 1) for k, v in sorted(kinds.items()) if v > 512})
    out["top_libraries"] = {n: round(v / 1024, 1) for n, v in libraries.most_common(6)}
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "", sys.argv[3] if len(sys.argv) > 3 else "")
