"""The documentation site (docs/): its generated reference pages match the code, and every shell
block a reader of Getting started or the Guides would paste either runs somewhere named or says
why it cannot run here. (`make lint` builds the site with `mkdocs build --strict`.)"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from kvhandoff.service.tools.docs.__main__ import PAGES, stale_pages
from kvhandoff.service.tools.docs.config import config_page
from kvhandoff.service.tools.docs.events import events_page
from kvhandoff.service.tools.docs.metrics import metrics_page
from kvhandoff.service.tools.docs.openapi import openapi_documents
from tests.engines import servers as engine_servers

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
SHELL_BLOCK = re.compile(r"^```(?:sh|bash|shell|console)\n", re.M)
MARKER = re.compile(r"<!-- (example|runs in): (.+?) -->")


def test_generated_pages_are_up_to_date() -> None:
    assert stale_pages(ROOT) == [], "run `make docs` and commit docs/reference/"


def test_a_page_that_differs_from_the_code_is_reported(tmp_path: Path) -> None:
    for rel in PAGES:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text((ROOT / rel).read_text())
    assert stale_pages(tmp_path) == []
    edited = tmp_path / "docs/reference/config.md"
    edited.write_text(edited.read_text().replace("`8100`", "`8200`", 1))
    (tmp_path / "docs/reference/events.md").unlink()
    assert stale_pages(tmp_path) == ["docs/reference/config.md", "docs/reference/events.md"]


def test_the_config_page_names_every_key_with_its_environment_variable() -> None:
    page = config_page()
    for key, env in [
        ("port", "KVHANDOFF_SERVER__PORT"),
        ("peer_timeout_s", "KVHANDOFF_HANDOFF__PEER_TIMEOUT_S"),
        ("protocol", "KVHANDOFF_TRANSPORT__PROTOCOL"),  # a MooncakeConfig field, inherited
        ("mode", "KVHANDOFF_TRANSFER__MODE"),
    ]:
        assert re.search(rf"\| `{key}` \|.*\| `{env}` \|", page), key
    assert "## `[[stages]]`" in page and "`KVHANDOFF_STAGES` as JSON" in page
    assert "A peer silent for this long fails its handoffs." in page  # a field's `#:` comment


def test_the_event_page_has_every_event_type_and_the_metrics_page_every_collector() -> None:
    events = events_page()
    for tag in ("handoff.created", "stage.segment_rejected", "handoff.released"):
        assert f"## `{tag}`" in events
    metrics = metrics_page()
    for name in (
        "kvhandoff_handoffs_accepted_total",  # the registry's own
        "kvhandoff_peer_up",  # PeerCollector
        "kvhandoff_arena_capacity_bytes",  # ArenaCollector
    ):
        assert f"| `{name}` |" in metrics
    assert "| `kvhandoff_stage_sent_bytes_total` | counter | `pp_rank` |" in metrics


def test_the_api_page_is_each_roles_own_document() -> None:
    docs = openapi_documents()
    assert "post" in docs["decode"]["paths"]["/v1/handoffs"]
    assert "/v1/handoffs/{id}/stages/{pp_rank}/ready" in docs["prefill"]["paths"]
    assert "/v1/handoffs/{id}/stages/{pp_rank}/ready" not in docs["decode"]["paths"]


def shell_blocks() -> list[tuple[str, int, str]]:
    """(page, line, the line above) of each shell block of Getting started and the Guides."""
    found = []
    for page in sorted([*DOCS.glob("getting-started/**/*.md"), *DOCS.glob("guides/**/*.md")]):
        text = page.read_text()
        for m in SHELL_BLOCK.finditer(text):
            line = text.count("\n", 0, m.start())
            above = text.splitlines()[line - 1] if line else ""
            found.append((str(page.relative_to(ROOT)), line + 1, above))
    return found


def test_the_shell_blocks_are_found() -> None:
    pages = {page for page, _, _ in shell_blocks()}
    assert {"docs/getting-started/install.md", "docs/guides/sglang/setup.md"} <= pages


@pytest.mark.parametrize(("page", "line", "above"), shell_blocks())
def test_each_shell_block_runs_somewhere_or_says_why_not(page: str, line: int, above: str) -> None:
    marker = MARKER.fullmatch(above.strip())
    assert marker, f"{page}:{line}: mark the block <!-- example: why --> or <!-- runs in: path -->"
    if marker[1] == "runs in":
        assert (ROOT / marker[2]).exists(), f"{page}:{line}: {marker[2]} does not exist"


README = ROOT / "README.md"
#: CI (.ci/run) and a hook look for this line: the README's test command, as pasted.
TEST_LINE = (
    "make test    # installs everything (apt libs, venvs, CPU torch, Mooncake, SGLang), "
    "runs every test"
)


def test_the_readme_is_short_and_keeps_its_test_command() -> None:
    text = README.read_text()
    assert len(text.encode()) < 8 * 1024, "the README is read in five minutes: move detail to docs/"
    assert TEST_LINE in text.splitlines()


def test_every_link_of_the_readme_resolves() -> None:
    links = re.findall(r"\]\(([^)]+)\)", README.read_text())
    assert links
    for link in links:
        assert "://" not in link and not link.startswith("#"), link
        assert (ROOT / link).exists(), f"README links to {link}, which does not exist"


ENGINE_PAGE = DOCS / "guides" / "sglang" / "support.md"


def engine_launch_lines() -> tuple[list[str], list[tuple[dict[str, str], list[str]]]]:
    """From the engine tests' block of the SGLang support page: `$COMMON`'s words, and each
    `launch_server` line's environment and the words after its `--port`."""
    text = ENGINE_PAGE.read_text()
    block = text.split("<!-- runs in: tests/engines/conftest.py -->\n```bash\n", 1)[1]
    block = block.split("\n```", 1)[0].replace("\\\n", " ")
    common: list[str] = []
    launches = []
    for line in block.splitlines():
        words = shlex.split(line, comments=True)
        if words and words[0].startswith("COMMON="):
            common = shlex.split(words[0].removeprefix("COMMON="))
        if "sglang.launch_server" not in words:
            continue
        env = dict(w.split("=", 1) for w in words[: words.index("python")])
        args = words[words.index("--port") + 2 :]
        launches.append((env, args))
    return common, launches


def test_the_engine_tests_launch_lines_are_what_the_tests_run() -> None:
    common, launches = engine_launch_lines()
    assert common[common.index("--host") + 2 :] == engine_servers.LAUNCH
    shown = sorted(
        args[: args.index("--disaggregation-bootstrap-port")]
        if "--disaggregation-bootstrap-port" in args
        else args
        for _, args in launches
    )
    assert shown == sorted(args for args, _ in engine_servers.SERVERS.values())
    for args, env in engine_servers.SERVERS.values():
        (line_env,) = [e for e, a in launches if a[: len(args)] == args]
        assert env.items() <= line_env.items(), (args, line_env)
        if "decode" in args:  # a decode refuses to start below kvhandoff's longest release
            release = "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT"
            assert line_env[release] == str(int(engine_servers.RELEASE_S))
