"""`mappa export RUN [--checkpoint NAME|PATH] --out DIR [--merge] [--push-to-hub REPO]`: the agents as adapters or
merged models, a model card, and the vLLM line that serves them (`mappa.export`)."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.markup import escape


def export_command(
    run_dir: str, out: str, checkpoint: str | None = None, merge: bool = False, push_to_hub: str | None = None
) -> int:
    from mappa.export import check_hub, export_run
    from mappa.export import push_to_hub as push

    console = Console(stderr=True, highlight=False)
    if push_to_hub:
        check_hub(push_to_hub)  # before minutes of merging: not logged in is one line now
    with console.status("exporting...") as status:
        done = export_run(run_dir, out, checkpoint=checkpoint, merge=merge, progress=status.update)
    what = "full models" if done.agent_weights == "full" else "merged models" if done.merged else "adapters"
    console.print(
        f"exported {len(done.dirs)} agents ({what}) of {escape(str(done.checkpoint))} to {escape(str(done.out))}"
    )
    for agent, directory in done.dirs.items():
        console.print(f"  {escape(agent)}: {escape(str(done.out / directory))}")
    console.print(f"model card: {escape(str(done.out / 'README.md'))}")
    console.print("serve with:")
    for line in done.serve_lines:  # stdout: the lines a script may take
        print(line)
    if push_to_hub:
        with console.status(f"uploading to {push_to_hub}..."):
            url = push(Path(done.out), push_to_hub)
        console.print(f"pushed to {url}")
    return 0
