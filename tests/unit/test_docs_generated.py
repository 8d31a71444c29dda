"""The reference pages under docs/reference/ are generated from the code (`python -m docs.gen`): each
committed page is what the code makes now, so a changed field, route, metric or option fails here
until the page is regenerated."""

from __future__ import annotations

import difflib

import pytest
from pydantic import BaseModel, Field

from docs.gen import COMMAND, DOCS, Generated, blocks, config


@pytest.mark.parametrize("block", blocks(), ids=lambda g: g.name)
def test_the_committed_reference_page_is_what_the_code_makes_now(block: Generated) -> None:
    committed = block.page.read_text()
    expected = block.expected(committed)
    if committed != expected:
        diff = "".join(list(difflib.unified_diff(committed.splitlines(True), expected.splitlines(True),
                                                 "committed", "from the code", n=1))[:40])
        pytest.fail(f"{block.page.relative_to(DOCS.parent)} is out of date with {block.source}: run `{COMMAND}` and "
                    f"commit the page\n{diff}")


def test_a_tenants_json_field_without_a_description_is_refused() -> None:
    class Undocumented(BaseModel):
        documented: int = Field(default=1, description="says what it is")
        bare: int = 0

    with pytest.raises(ValueError, match=r"Undocumented\.bare .* has no description"):
        list(config.rows(Undocumented))


def test_every_generated_page_is_in_the_site_navigation() -> None:
    nav = (DOCS.parent / "mkdocs.yml").read_text()
    missing = [g.page.relative_to(DOCS).as_posix() for g in blocks() if g.page.relative_to(DOCS).as_posix() not in nav]
    assert not missing, f"generated pages missing from mkdocs.yml's nav: {missing}"
