#!/usr/bin/env python3
"""Follows an Accrue run's metrics.jsonl and logs it to Weights & Biases or
MLflow: every number of each step line as `train/NAME` (nested keys joined
with `/`, the same names as the coordinator's TensorBoard files), each eval
line as `eval/NAME`, at the line's step.

usage:
  scripts/track.py wandb  runs/my-sft/metrics.jsonl [--project P] [--run-name N] [--offline] [--follow]
  scripts/track.py mlflow runs/my-sft/metrics.jsonl [--experiment E] [--run-name N] [--tracking-uri URI] [--follow]

Without --follow it logs what the file holds and ends the run; with it, it
keeps reading lines as the coordinator appends them until the job's last
step (`--steps`), `--idle-exit` seconds without a new line, or Ctrl-C. A step
written twice (re-committed after a recovery) is logged once, from its
first line (W&B refuses steps that go back). The tracker's package is
installed on first use (pinned; into the running Python).
"""
import argparse
import importlib
import json
import os
import subprocess
import sys
import time

PINS = {"wandb": "wandb==0.31.0", "mlflow": "mlflow-skinny==3.17.2"}
SKIP = ("unix_ms", "cursor")


def ensure(module):
    try:
        return importlib.import_module(module)
    except ImportError:
        subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", PINS[module]])
        return importlib.import_module(module)


def flatten(prefix, value, out):
    """Numbers of a JSON value as {prefix/key/...: float}."""
    if isinstance(value, bool):
        return
    if isinstance(value, (int, float)):
        out[prefix] = float(value)
    elif isinstance(value, dict):
        for k, v in value.items():
            if k in SKIP:
                continue
            flatten(f"{prefix}/{k}", v, out)


def records(line, where):
    """(step, {name: value}) of one metrics.jsonl line, or None for a blank."""
    line = line.strip()
    if not line:
        return None
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise SystemExit(f"{where}: not JSON: {e}")
    if "eval" in obj:
        ev = obj["eval"]
        values = {}
        flatten("eval", ev, values)
        values.pop("eval/step", None)
        return ("eval", int(ev["step"]), values)
    if "step" not in obj:
        raise SystemExit(f"{where}: no step field")
    values = {}
    flatten("train", obj, values)
    values.pop("train/step", None)
    return ("train", int(obj["step"]), values)


class Wandb:
    def __init__(self, args, name):
        self.wandb = ensure("wandb")
        self.run = self.wandb.init(
            project=args.project,
            name=args.run_name or name,
            mode="offline" if args.offline else None,
            dir=args.dir,
        )

    def log(self, step, values):
        self.run.log(values, step=step)

    def finish(self):
        self.run.finish()


class Mlflow:
    def __init__(self, args, name):
        self.mlflow = ensure("mlflow")
        if args.tracking_uri:
            self.mlflow.set_tracking_uri(args.tracking_uri)
        self.mlflow.set_experiment(args.experiment)
        self.run = self.mlflow.start_run(run_name=args.run_name or name)

    def log(self, step, values):
        # MLflow metric names allow "/", and NaN is refused: skip it.
        clean = {k: v for k, v in values.items() if v == v}
        self.mlflow.log_metrics(clean, step=step)

    def finish(self):
        self.mlflow.end_run()


def follow(path, args, sink):
    logged = {"train": -1, "eval": -1}
    last_new = time.monotonic()
    lineno = 0
    steps = 0
    with open(path, encoding="utf-8") as f:
        pending = ""
        while True:
            chunk = f.readline()
            if chunk:
                pending += chunk
                if not pending.endswith("\n") and args.follow:
                    continue  # a line still being written
                lineno += 1
                rec = records(pending, f"{path}:{lineno}")
                pending = ""
                last_new = time.monotonic()
                if rec is None:
                    continue
                kind, step, values = rec
                if step <= logged[kind]:
                    continue
                logged[kind] = step
                sink.log(step, values)
                steps += kind == "train"
                if args.steps and kind == "train" and step >= args.steps:
                    break
                continue
            if not args.follow:
                break
            if args.idle_exit and time.monotonic() - last_new > args.idle_exit:
                break
            time.sleep(args.poll)
    return steps


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("tracker", choices=["wandb", "mlflow"])
    p.add_argument("metrics", help="a run's metrics.jsonl")
    p.add_argument("--run-name", help="default: the run directory's name")
    p.add_argument("--follow", action="store_true", help="keep reading appended lines")
    p.add_argument("--steps", type=int, default=0, help="with --follow: stop after this step")
    p.add_argument("--idle-exit", type=float, default=0, help="with --follow: stop after this many seconds without a line")
    p.add_argument("--poll", type=float, default=2.0, help="seconds between reads when following")
    p.add_argument("--project", default="accrue", help="W&B project")
    p.add_argument("--offline", action="store_true", help="W&B offline mode (sync later with `wandb sync`)")
    p.add_argument("--dir", default=None, help="W&B's local directory")
    p.add_argument("--experiment", default="accrue", help="MLflow experiment")
    p.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default: MLFLOW_TRACKING_URI)")
    args = p.parse_args()
    if not os.path.isfile(args.metrics):
        raise SystemExit(f"{args.metrics}: no such file")
    name = os.path.basename(os.path.dirname(os.path.abspath(args.metrics)))
    sink = Wandb(args, name) if args.tracker == "wandb" else Mlflow(args, name)
    try:
        n = follow(args.metrics, args, sink)
    except KeyboardInterrupt:
        n = None
    sink.finish()
    print(json.dumps({"tracker": args.tracker, "steps": n}))


if __name__ == "__main__":
    main()
