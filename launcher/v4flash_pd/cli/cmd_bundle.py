"""`v4flash-pd bundle create|verify|load`: the air-gapped reinstall (docs/bundle.md)."""

from __future__ import annotations

from pathlib import Path

import click

DEFAULT_IMAGE = "v4flash-pd:latest"  # what `make image` tags (podman resolves it to localhost/)


def _log(msg: str) -> None:
    click.echo(msg, err=True)


def _require(*modules: str) -> None:
    """The bundle extra's deps (docker SDK, zstandard) are optional for the launcher: say so."""
    import importlib.util

    from v4flash_pd.errors import UserError

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise UserError(
            f"`v4flash-pd bundle` needs the Python package(s) {', '.join(missing)}, which are not installed",
            "pip install '.[bundle]' in the v4flash-pd checkout (the project is not on PyPI), or pip install docker "
            "zstandard; the image has both",
        )


@click.group("bundle")
def command() -> None:
    """Move the whole stack across an air gap in one checked directory.

    Connected side: `bundle create --out DIR`. Copy DIR (and the model dir) across.
    Disconnected side: `bundle verify DIR --model PATH`, then `bundle load DIR`.
    Signed bundles: `create --sign KEY`, then `verify/load --trust KEY.pub`.
    """


_jobs = click.option("--jobs", type=click.IntRange(1, 1024), default=None, envvar="V4FLASH_BUNDLE_JOBS",
                     help="Hashing threads (default: every core this process may use).")
_quiet = click.option("--no-progress", is_flag=True, envvar="V4FLASH_BUNDLE_NO_PROGRESS",
                      help="No progress bars (summary lines are still printed).")
_trust = click.option("--trust", "trust", metavar="PUBKEY", type=click.Path(path_type=Path), default=None,
                      envvar="V4FLASH_BUNDLE_TRUST",
                      help="Require a good signature over SHA256SUMS by this OpenSSH public key (.pub file).")
_engine = click.option("--engine", metavar="URL", default=None, envvar="V4FLASH_ENGINE",
                       help="Engine API endpoint, e.g. unix:///run/podman/podman.sock (default: DOCKER_HOST).")


@command.command("create")
@click.option("--out", "out", type=click.Path(path_type=Path), required=True, envvar="V4FLASH_BUNDLE_OUT",
              help="Bundle directory to create (must not exist).")
@click.option("--image", "image", metavar="REF", default=None, envvar="V4FLASH_BUNDLE_IMAGE",
              help=f"Image to save from the engine [default: {DEFAULT_IMAGE}].")
@click.option("--no-image", is_flag=True, envvar="V4FLASH_BUNDLE_NO_IMAGE", help="Do not include an image.")
@click.option("--model", type=click.Path(path_type=Path, file_okay=False), default=None, envvar="V4FLASH_BUNDLE_MODEL",
              help="Model dir to write a manifest for (sha256 + size of every file).")
@click.option("--wheelhouse", "wheelhouse", metavar="[DIR]", is_flag=False, flag_value=":download:", default=None,
              envvar="V4FLASH_BUNDLE_WHEELHOUSE",
              help="Add the locked wheels: copied from DIR, or (no value) downloaded with pip.")
@click.option("--lock", "lock_path", type=click.Path(path_type=Path, dir_okay=False), default=None,
              envvar="V4FLASH_STACK_LOCK", help="Stack lock to bundle [default: the one v4flash-pd ships].")
@click.option("--zstd-level", type=click.IntRange(1, 22), default=3, show_default=True,
              envvar="V4FLASH_BUNDLE_ZSTD_LEVEL", help="zstd level for the image archive (19 = smallest, slow).")
@click.option("--sign", "sign", metavar="KEY", type=click.Path(path_type=Path), default=None,
              envvar="V4FLASH_BUNDLE_SIGN",
              help="Sign SHA256SUMS with this OpenSSH private key (ssh-keygen -Y sign), or its .pub when the "
                   "key is in ssh-agent.")
@_engine
@_jobs
@_quiet
def create_cmd(out: Path, image: str | None, no_image: bool, model: Path | None, wheelhouse: str | None,
               lock_path: Path | None, zstd_level: int, sign: Path | None, engine: str | None, jobs: int | None,
               no_progress: bool) -> None:
    """Write a bundle: image (zstd), stack lock, SBOM, [wheelhouse], [model manifest], checksums."""
    from v4flash_pd.errors import UserError

    _require("zstandard", *(() if no_image else ("docker",)))
    from v4flash_pd.bundle.create import DOWNLOAD, CreateOptions, create_bundle

    if image and no_image:
        raise UserError("--image and --no-image contradict each other", "pass one of them")
    opts = CreateOptions(
        out=out,
        image=None if no_image else (image or DEFAULT_IMAGE),
        model=model,
        wheelhouse=(wheelhouse if wheelhouse in (None, DOWNLOAD) else Path(wheelhouse)),
        engine=engine,
        zstd_level=zstd_level,
        jobs=jobs,
        lock_path=lock_path,
        show_progress=not no_progress,
        sign=sign,
    )
    path = create_bundle(opts, log=_log)
    click.echo(str(path))


@command.command("verify")
@click.argument("bundle_dir", type=click.Path(path_type=Path), envvar="V4FLASH_BUNDLE_DIR")
@click.option("--model", type=click.Path(path_type=Path), default=None, envvar="V4FLASH_BUNDLE_MODEL",
              help="Check this model dir against the bundled manifest.")
@click.option("--full", is_flag=True, envvar="V4FLASH_BUNDLE_FULL",
              help="Hash every model file (default: sizes only).")
@_trust
@_jobs
@_quiet
def verify_cmd(bundle_dir: Path, model: Path | None, full: bool, trust: Path | None, jobs: int | None,
               no_progress: bool) -> None:
    """Check every checksum, the image archive, SBOM/lock and (with --model) the model. No network."""
    _require("zstandard")
    from v4flash_pd.bundle.signing import load_trust
    from v4flash_pd.bundle.verify import raise_if_failed, render_table, verify_bundle

    trusted = load_trust(trust) if trust is not None else None
    report = verify_bundle(bundle_dir, model=model, full=full, jobs=jobs, show_progress=not no_progress,
                           trust=trusted)
    click.echo(render_table(report))
    raise_if_failed(report)
    click.echo(f"bundle {bundle_dir}: all checks passed")


@command.command("load")
@click.argument("bundle_dir", type=click.Path(path_type=Path), envvar="V4FLASH_BUNDLE_DIR")
@click.option("--model", type=click.Path(path_type=Path), default=None, envvar="V4FLASH_BUNDLE_MODEL",
              help="Also check this model dir, then install the manifest into it for `up`.")
@click.option("--full", is_flag=True, envvar="V4FLASH_BUNDLE_FULL", help="Hash every model file.")
@_trust
@_engine
@_jobs
@_quiet
def load_cmd(bundle_dir: Path, model: Path | None, full: bool, trust: Path | None, engine: str | None,
             jobs: int | None, no_progress: bool) -> None:
    """Verify the bundle, then load its image and check the loaded image ID. Nothing loads on failure."""
    _require("zstandard", "docker")
    from v4flash_pd.bundle.load import load_bundle
    from v4flash_pd.bundle.signing import load_trust

    trusted = load_trust(trust) if trust is not None else None
    result = load_bundle(bundle_dir, engine=engine, model=model, full=full, jobs=jobs,
                         show_progress=not no_progress, log=click.echo, trust=trusted)
    click.echo(f"loaded {result.image_id}")
