"""An HTML page as a tree of elements, for tests that read a page by its classes and ids (the
standard library's parser: no browser, no dependency).

    tree = Tree(text)
    tree.root.first("headline").words()     # an element's text, whitespace collapsed
    tree.ids["s0-warning-2"].tag            # "tr"
"""

from __future__ import annotations

from dataclasses import dataclass, field
from html.parser import HTMLParser


@dataclass
class Element:
    """One element: its tag, attributes, children, and all the text inside it."""

    tag: str
    attrs: dict[str, str | None]
    children: list[Element] = field(default_factory=list)
    text: str = ""

    @property
    def classes(self) -> list[str]:
        return (self.attrs.get("class") or "").split()

    def find(self, css_class: str) -> list[Element]:
        """Every element inside this one (this one too) of class `css_class`, in page order."""
        found = [self] if css_class in self.classes else []
        return found + [e for child in self.children for e in child.find(css_class)]

    def first(self, css_class: str) -> Element:
        """The first element of `find`; the test fails where there is none."""
        found = self.find(css_class)
        assert found, f"no element of class {css_class!r}"
        return found[0]

    def each(self, tag: str) -> list[Element]:
        """Every element inside this one (this one too) with tag `tag`, in page order."""
        found = [self] if self.tag == tag else []
        return found + [e for child in self.children for e in child.each(tag)]

    def words(self) -> str:
        """The text inside, its whitespace collapsed (as a browser shows it)."""
        return " ".join(self.text.split())


class Tree(HTMLParser):
    """A page as a tree of elements, each with its text (its children's included); elements
    left open (a page cut short) are closed at the end."""

    VOID = {"meta", "br", "hr", "img", "link", "input", "wbr", "col", "area", "base", "source"}

    def __init__(self, text: str):
        super().__init__(convert_charrefs=True)
        self.root = Element("document", {})
        self.open = [self.root]
        self.ids: dict[str, Element] = {}
        self.feed(text)
        self.close()

    def handle_starttag(self, tag, attrs):
        element = Element(tag, dict(attrs))
        self.open[-1].children.append(element)
        if element.attrs.get("id"):
            self.ids[element.attrs["id"]] = element
        if tag not in self.VOID:
            self.open.append(element)

    def handle_endtag(self, tag):
        if any(e.tag == tag for e in self.open[1:]):
            while self.open.pop().tag != tag:
                pass

    def handle_data(self, data):
        for element in self.open:
            element.text += data
