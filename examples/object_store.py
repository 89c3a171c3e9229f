"""The training loop of train_minimal.py, checkpointing to an object store, then checking the result.

    pip install 'zarrckpt[s3]'     # or zarrckpt[gcs]
    python examples/object_store.py s3://my-bucket/runs/demo
    python examples/object_store.py gs://my-bucket/runs/demo
    python examples/object_store.py s3://bucket/run -o endpoint_url=http://127.0.0.1:9000   # MinIO, moto...

Run it again and it resumes from the newest committed step. Credentials come from
wherever s3fs and gcsfs look (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_PROFILE,
GOOGLE_APPLICATION_CREDENTIALS, instance metadata...) or from `-o key=value` storage
options, which are passed to fsspec as they are (values parsed as JSON when they parse).

Nothing is renamed on the store: each save writes its objects concurrently, and the
commit is one last write of the step's `zarr.json`. At the end the newest step is
verified (`zarrckpt verify URL/<step>` does the same from a shell).
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from train_minimal import train  # noqa: E402  (this directory is on sys.path)

import zarrckpt  # noqa: E402


def storage_option(text: str) -> tuple[str, object]:
    key, _, value = text.partition("=")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("url", help="checkpoint directory, e.g. s3://bucket/run or gs://bucket/run")
    parser.add_argument("-o", "--storage-option", metavar="KEY=VALUE", action="append", type=storage_option,
                        default=[], help="fsspec storage option (repeatable)")
    parser.add_argument("--steps", type=int, default=30, help="steps to train in this run")
    parser.add_argument("--save-every", type=int, default=10)
    args = parser.parse_args()
    options = dict(args.storage_option) or None

    train(args.url, args.steps, args.save_every, keep_last=2, storage_options=options)
    steps = zarrckpt.all_steps(args.url, storage_options=options)
    print(f"committed steps in {args.url}: {steps}")
    newest = f"{args.url.rstrip('/')}/{steps[-1]:010d}"
    report = zarrckpt.verify(newest, storage_options=options)
    print(f"verify {newest}: {'OK' if report.ok else 'DAMAGED'} ({report.chunks_checked} chunks checked)")
    if not report.ok:
        raise SystemExit("\n".join(map(str, report.problems)))


if __name__ == "__main__":
    main()
