"""machgen-build: model folders in, Triton model repositories out."""

from __future__ import annotations

from pathlib import Path

import typer

from machgen.builder.registry import family_names

app = typer.Typer(help="Export diffusion models and write Triton model repositories.", no_args_is_help=True,
                  add_completion=False)


@app.command("families")
def list_families() -> None:
    """List the supported model families."""
    for name in family_names():
        typer.echo(name)


@app.command()
def tiny(
    family: str = typer.Argument(..., help=f"model family: {', '.join(family_names())}"),
    out: Path = typer.Argument(..., help="folder to write the diffusers pipeline into"),
) -> None:
    """Write a tiny deterministic random-weight pipeline folder (for tests and demos)."""
    from machgen.builder.build import write_tiny_model
    from machgen.builder.registry import get_family

    try:
        chosen = get_family(family)
    except KeyError as err:
        raise typer.BadParameter(str(err.args[0]), param_hint="FAMILY") from None
    write_tiny_model(chosen, out)
    typer.echo(f"wrote tiny {family} pipeline to {out}")


@app.command()
def build(
    model_dir: Path = typer.Argument(..., exists=True, file_okay=False, help="diffusers model folder"),
    name: str = typer.Option(..., "--name", help="public model name the pipeline is served under"),
    target: str = typer.Option("onnxruntime", "--target", help="engine target: onnxruntime (CPU)"),
    out: Path = typer.Option(Path("model_repository"), "--out", help="model repository to write into"),
) -> None:
    """Export every component, check it against torch, and write the model repository."""
    from machgen.builder.build import build_repository
    from machgen.builder.export import ParityError

    if not name.replace("_", "").replace("-", "").isalnum():
        raise typer.BadParameter("use letters, digits, '_' and '-'", param_hint="--name")
    try:
        build_repository(model_dir, name, out, target=target, log=typer.echo)
    except (ParityError, ValueError, KeyError, FileNotFoundError) as err:
        typer.secho(f"error: {err}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None


if __name__ == "__main__":  # pragma: no cover
    app()
