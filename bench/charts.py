"""Bench results as charts for `caravan report` (the "caravan-bench-1" charts.json of
docs/report.md). Standard library only.

    import charts
    charts.write(out_dir, "network", "OSP against BSP under limited bandwidth", [
        charts.line("speedup", "Speedup over ps-bsp", "link rate (Mbit/s)", "speedup",
                    [charts.series("osp", [100, 300], [1.9, 1.5]),
                     charts.series("bound", [100, 300], [2.0, 1.7], dashed=True)], log_x=True),
        charts.bar("throughput", "Samples per second", ["1gbit", "100mbit"],
                   [charts.series("osp", y=[5200, 3900])], "samples / s"),
    ], note="...", command="...", table=charts.table(["rate", "mode"], [["1gbit", "osp"]]))

NaN and infinities become null (a missing point), floats keep six significant digits, and a
series that does not fit its chart (x and y of different lengths, a bar series without one y
per label) raises ValueError before anything is written.
"""
import json
import math
import os
import tempfile

FORMAT = "caravan-bench-1"


def _clean(v):
    """JSON-safe copy: NaN/inf -> None, floats to 6 significant digits, tuples -> lists."""
    if isinstance(v, bool) or v is None or isinstance(v, (int, str)):
        return v
    if isinstance(v, float):
        return float(f"{v:.6g}") if math.isfinite(v) else None
    if isinstance(v, dict):
        return {str(k): _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    if hasattr(v, "__float__"):  # e.g. a numpy scalar
        return _clean(float(v))
    return str(v)


def _positive(values):
    """For a log axis: a value <= 0 cannot be drawn, so it becomes a missing point."""
    return [v if v is None or not isinstance(v, (int, float)) or v > 0 else None for v in values]


def series(name, x=None, y=None, dashed=False):
    """One line (x and y) or one bar series (y only, one per label); None for a missing point."""
    s = {"name": str(name), "y": list(y if y is not None else [])}
    if x is not None:
        s["x"] = list(x)
    if dashed:
        s["dashed"] = True
    return s


def line(id, title, x_label, y_label, series, log_x=False, log_y=False):
    out = []
    for s in series:
        if "x" not in s or len(s["x"]) != len(s["y"]):
            raise ValueError(f"chart {id}: series {s.get('name')!r} needs x and y of one length")
        s = dict(s)
        if log_x:
            s["x"] = _positive(s["x"])
        if log_y:
            s["y"] = _positive(s["y"])
        out.append(s)
    return {"id": id, "title": title, "type": "line", "x_label": x_label, "y_label": y_label,
            "log_x": bool(log_x), "log_y": bool(log_y), "series": out}


def bar(id, title, labels, series, y_label, stacked=False, x_label=None, log_y=False):
    labels = [str(l) for l in labels]
    out = []
    for s in series:
        if len(s["y"]) != len(labels):
            raise ValueError(f"chart {id}: series {s.get('name')!r} needs one y per label "
                             f"({len(s['y'])} for {len(labels)})")
        s = {k: v for k, v in s.items() if k != "x"}
        if log_y:
            s["y"] = _positive(s["y"])
        out.append(s)
    c = {"id": id, "title": title, "type": "bar", "labels": labels, "y_label": y_label,
         "stacked": bool(stacked), "series": out}
    if x_label:
        c["x_label"] = x_label
    if log_y:
        c["log_y"] = True
    return c


def table(columns, rows):
    """A table under the charts; cells are strings or numbers (None shows as a dash)."""
    columns = [str(c) for c in columns]
    for r in rows:
        if len(r) != len(columns):
            raise ValueError(f"table row {r!r} has {len(r)} cells for {len(columns)} columns")
    return {"columns": columns, "rows": [list(r) for r in rows]}


def markdown_table(text, index=0):
    """The index-th markdown table ("| a | b |" lines under a "|---|" rule) of `text` as a
    table(); None where there is none. Lets a chart's table mirror a printed table exactly."""
    found = []
    lines = text.splitlines()
    i = 0
    while i + 1 < len(lines):
        head, rule = lines[i].strip(), lines[i + 1].strip()
        if head.startswith("|") and rule.startswith("|") and set(rule) <= set("|-: "):
            rows = []
            j = i + 2
            while j < len(lines) and lines[j].strip().startswith("|"):
                rows.append(_cells(lines[j]))
                j += 1
            found.append((_cells(head), rows))
            i = j
        else:
            i += 1
    if index >= len(found):
        return None
    columns, rows = found[index]
    rows = [(r + [""] * len(columns))[: len(columns)] for r in rows]
    return table(columns, rows)


def _cells(row):
    row = row.strip()
    return [c.strip() for c in row[1:-1 if row.endswith("|") else None].split("|")]


def write(out, name, title, charts, note=None, command=None, table=None):
    """Writes charts.json (or the .json file `out` names) atomically; returns its path."""
    path = out if out.endswith(".json") else os.path.join(out, "charts.json")
    doc = {"format": FORMAT, "name": name, "title": title}
    if note:
        doc["note"] = note
    if command:
        doc["command"] = command
    doc["charts"] = list(charts)
    if table:
        doc["table"] = table
    text = json.dumps(_clean(doc), indent=1, allow_nan=False) + "\n"
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".charts-", suffix=".json.tmp", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


def beside(results_path):
    """The charts.json next to a results file (the scripts that write --json FILE)."""
    return os.path.join(os.path.dirname(os.path.abspath(results_path)), "charts.json")


def command(script, args, skip=("replot",), repeated=()):
    """The command line that gives `script` these parsed arguments (a dict such as vars(args)
    or the "args" a results file stores): ".venv/bin/python SCRIPT --key value ...", or None
    when `args` is None (a results file from before they were stored). Flags that are False,
    None or empty are left out; a list is one flag with several values (nargs="+"), or for the
    keys in `repeated` the flag once per value (action="append")."""
    if args is None:
        return None
    parts = [".venv/bin/python", script]
    for k, v in args.items():
        if k in skip or v is None or v is False or v == [] or v == "":
            continue
        flag = "--" + k.replace("_", "-")
        if v is True:
            parts.append(flag)
        elif k in repeated:
            parts += [_option(flag, x) for x in v]
        elif isinstance(v, (list, tuple)):
            parts += [flag] + [_word(x) for x in v]
        else:
            parts.append(_option(flag, v))
    return " ".join(parts)


def _option(flag, v):
    """--flag value, or --flag=value where the value looks like an option itself."""
    w = _word(v)
    return f"{flag}={w}" if w.startswith("-") else f"{flag} {w}"


def _word(v):
    s = f"{v:g}" if isinstance(v, float) else str(v)
    return s if s and all(c.isalnum() or c in "-_./=:+,@%" for c in s) else "'" + s.replace(
        "'", "'\\''") + "'"
