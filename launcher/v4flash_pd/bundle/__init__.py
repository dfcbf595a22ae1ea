"""Air-gapped reinstall bundles: everything a disconnected cluster needs, in one checked directory.

Two phases (docs/bundle.md): `create` on the connected side writes the image archive, the stack lock,
its SBOM, an optional wheelhouse and a model manifest, then SHA256SUMS + MANIFEST.json over all of
it; `verify` / `load` on the disconnected side prove the copy arrived intact before anything is used.
Modules have one job each; the CLI glue is `v4flash_pd.cli.cmd_bundle`.
"""
