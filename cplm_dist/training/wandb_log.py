"""Weights & Biases for a run (`train.wandb=true`), written by rank 0 beside metrics.jsonl:

    <out_dir>/logs/wandb_run.json   {"id", "project", "entity"}: the run's W&B id, made at its first start
    <out_dir>/logs/wandb/           wandb's own directory (offline: offline-run-<time>-<id>/run-<id>.wandb)

The id is ours to keep. Online, every start of the run in its out_dir (a resume, a restart, a
requeue; `--resume` from another run's checkpoint into a new out_dir starts a new W&B run) calls
`wandb.init(id=<that id>, resume="allow")`, so the W&B run continues instead of splitting into one
run a start. Offline (WANDB_MODE=offline, a cluster without a route out) W&B ignores `resume`:
each start writes its own offline-run directory, all under the same id, and its history goes on
from the resumed step; `wandb sync <out_dir>/logs/wandb/offline-run-*` uploads them in start order
into that one run. Steps a resume recomputes (metrics.jsonl keeps the later record) are dropped
online by W&B, which keeps a run's steps increasing: its history shows the first values.

Every record of metrics.jsonl that has a step goes to W&B as `<event>/<key>` ("train/loss",
"valid/loss", "resume/recomputed"; a sparse model's "train/moe/L0/max_load", its
"train/moe/L0/tokens_per_expert/<expert>"); the run's name is train.out_dir's last part, its config
the whole resolved config, its group and tags train.wandb_group and train.wandb_tags.

W&B is an outside service: when it fails (it does not start -- no login, no route, a bad entity
-- or a later upload or its closing raises) rank 0 prints one warning line and training goes on
without it, its metrics in metrics.jsonl as always; the next start of the run (a requeue) tries
again under the same id. A requeued multi-day run never ends for a W&B outage. Only a missing
package is an error, found before anything starts (`check_wandb`): an install to fix, not an outage.
"""

from __future__ import annotations

import importlib.util
import json
import secrets
import string
import sys
from pathlib import Path

from cplm_dist.config import Config, to_dict
from cplm_dist.errors import ConfigError, UsageError
from cplm_dist.files import write_text_atomic

RUN_FILE = "wandb_run.json"


class WandbError(UsageError):
    """W&B could not start (one line: the warning's reason)."""


def warn(message: str) -> None:
    """A logger's failure, as the one line the run prints for it (rank 0, stderr)."""
    print(f"warning: {message}", file=sys.stderr, flush=True)


def first_line(e: BaseException) -> str:
    return ((str(e).strip().splitlines() or [type(e).__name__])[0])[:200]


def check_wandb(cfg: Config) -> None:
    """Before the process group: train.wandb=true needs the package."""
    if cfg.train.wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError("train.wandb=true needs the wandb package: pip install wandb (or set train.wandb=false)")


def saved_run_id(log_dir: Path) -> str | None:
    """The id of this run's W&B run (made at its first start, kept across every resume), if any."""
    path = log_dir / RUN_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())["id"]
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError):
        raise WandbError(f"{path} is not a W&B run record ({{\"id\": ...}}): remove it to start a new W&B run "
                         "(the metrics of earlier starts stay in their own run)") from None


def save_run_id(log_dir: Path, run) -> None:
    """After the first start succeeded: its id, for every later start (written whole, then renamed)."""
    write_text_atomic(log_dir / RUN_FILE, json.dumps({"id": run.id, "project": run.project, "entity": run.entity}) + "\n")


def start_wandb(cfg: Config, log_dir: Path):
    """The W&B run (rank 0 only), or None with one warning line when it does not start."""
    try:
        return _init(cfg, log_dir)
    except UsageError as e:
        reason = str(e)
    except Exception as e:  # noqa: BLE001 - wandb's own errors (no login, no server, a bad entity): one line
        reason = (f"train.wandb=true: W&B did not start ({first_line(e)}): log in (`wandb login` or WANDB_API_KEY), "
                  "log offline with WANDB_MODE=offline, or set train.wandb=false")
    warn(f"{reason}; training goes on without W&B (every record is in {log_dir / 'metrics.jsonl'})")
    return None


def _init(cfg: Config, log_dir: Path):
    import wandb

    t, saved = cfg.train, saved_run_id(log_dir)
    new = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))  # W&B's own id alphabet
    run = wandb.init(project=t.wandb_project, entity=t.wandb_entity, group=t.wandb_group, tags=list(t.wandb_tags) or None,
                     id=saved or new, resume="allow",
                     name=Path(t.out_dir).resolve().name, config=to_dict(cfg), dir=str(log_dir),
                     settings=wandb.Settings(console="off", init_timeout=120))
    if saved is None:
        try:
            save_run_id(log_dir, run)
        except OSError as e:  # without the id a resume would split the W&B run: closed, the run goes on without it
            run.finish(exit_code=1)
            raise WandbError(f"train.wandb=true: cannot keep the W&B run's id in {log_dir / RUN_FILE} ({e}): "
                             "make train.out_dir writable") from None
    return run


def wandb_values(event: str, values: dict) -> dict:
    """A metrics.jsonl record as W&B keys (`<event>/<key>`, nested records as `<event>/<key>/<sub>/...`:
    the per-source figures), numbers and strings only."""
    return {k: v for k, v in flat_values(event, values).items() if isinstance(v, (int, float, str))}


def flat_values(prefix: str, values: dict) -> dict:
    """{"<prefix>/<key>[/<sub>...]": value} of a record without its step: nested dicts flattened, a
    list of numbers as one key an item (`<key>/<index>`)."""
    out = {}
    for key, value in values.items():
        if key == "step" and "/" not in prefix:
            continue
        if isinstance(value, dict):
            out.update(flat_values(f"{prefix}/{key}", value))
        elif isinstance(value, list) and value and all(isinstance(v, (int, float)) for v in value):
            out.update({f"{prefix}/{key}/{i}": v for i, v in enumerate(value)})  # per expert: moe/L<i>/tokens_per_expert/<j>
        else:
            out[f"{prefix}/{key}"] = value
    return out
