"""The README's walkthrough shows what the commands really print: the quickstart and its resume
are run here and compared with the README's blocks, line by line, job ids and paths aside."""

from __future__ import annotations

import re

from helpers import REPO, Agent

README = (REPO / "README.md").read_text()


def _block_after(marker: str) -> list[str]:
    start = README.index(marker)
    opening = README.index("```", start)
    body = README[README.index("\n", opening) + 1 : README.index("```", opening + 3)]
    return [line for line in body.splitlines() if line and not line.startswith("$ ")]


def _normalized(lines: list[str], ids: list[str]) -> list[str]:
    out = []
    for line in lines:
        for index, job_id in enumerate(ids):
            line = line.replace(job_id, f"<job{index}>")
        # The README shows paths as a reader's would read: relative, or under ~
        line = re.sub(r"(file://)?(~|\.bt-node|examples)?/\S*", "<path>", line)
        # and how long an upload took on one machine: a busy one takes a tenth or two more
        out.append(re.sub(r" in \d+\.\d s$", " in <seconds> s", line))
    return out


def _job_id(text: str) -> str:
    found = re.search(r"bt-agent: job ([a-z0-9]{7}) ", text)
    assert found, text
    return found.group(1)


def test_quickstart_and_resume_print_what_the_readme_shows(agent: Agent) -> None:
    node = str(agent.root / ".bt-node")
    first = agent("run", str(REPO / "examples/quickstart/job.json"), "--node-root", node)
    assert first.code == 0, first.text
    second = agent("run", str(REPO / "examples/quickstart/resume.json"), "--node-root", node)
    assert second.code == 0, second.text
    shown = {
        "first": _block_after("What the quickstart prints"),
        "second": _block_after("**Resume.**"),
    }
    readme_ids = [_job_id("\n".join(shown["first"])), _job_id("\n".join(shown["second"]))]
    run_ids = [_job_id(first.err), _job_id(second.err)]
    for key, result in (("first", first), ("second", second)):
        expected = _normalized(shown[key], readme_ids)
        agent_lines = [line for line in expected if line.startswith("bt-agent:")]
        program_lines = [line for line in expected if not line.startswith("bt-agent:")]
        assert _normalized(result.err.splitlines(), run_ids) == agent_lines
        assert _normalized(result.out.splitlines(), run_ids) == program_lines


DOCS = [REPO / "README.md", REPO / "RELIABILITY.md", *sorted((REPO / "docs").glob("*.md"))]


def test_the_documents_link_to_files_that_exist() -> None:
    for document in DOCS:
        text = document.read_text()
        for target in re.findall(r"\]\(([^)#:]+)\)", text):
            assert (document.parent / target).exists(), f"{document.name} links to {target}"


def test_the_documents_name_no_path_of_one_machine() -> None:
    """Example output shows paths as any reader's would be: relative, under ~, or container
    paths; never a test's temporary dir, an interpreter's or a checkout's location."""
    one_machine = r"(?:/work/|file:///tmp/|/\.pyenv/|pytest-of-|/tmp/tmp|/tmp/bt-)\S*"
    for document in [*DOCS, REPO / "benchmarks" / "RESULTS.md"]:
        found = re.findall(one_machine, document.read_text())
        assert not found, f"{document.name}: {found}"
