"""A conversation's layout from one rendering, for chat templates that provably render every prefix of a
conversation as a prefix of the whole (ChatML, SmolLM2's, most simple templates).

prepare.chat_layout renders each assistant turn's context (with the generation prompt) and the conversation through
the turn: two renderings per turn, each of everything before it, a fifth of the preparation's CPU time on short
chats. Where the template's syntax tree shows that what it writes for message j depends on messages 0..j only, and
that the generation prompt depends on no message, one rendering of the whole conversation with the generation prompt
gives all of them: the output so far when the loop takes message j is the rendering of the first j messages, and the
generation prompt is what follows the loop. Anything the check cannot see through (a look-ahead such as `loop.last`
or `messages|length`, a scan of the messages before the loop as Qwen3's, the generation prompt used inside the loop,
includes, an error) leaves the layout to the per-prefix renderings. tests/test_formats.py holds the two equal.
"""

from __future__ import annotations

from jinja2 import nodes

# What `loop` of the message loop may be asked for: values that look back only, the same in a prefix's rendering.
BACKWARD = frozenset({"first", "index", "index0", "previtem", "changed", "cycle", "depth", "depth0"})
UNSEEN = (nodes.Extends, nodes.Include, nodes.Import, nodes.FromImport, nodes.Block)


def one_pass(source: str, env) -> bool:
    """The template `source` renders message j from messages 0..j (and variables) only, and outside its one loop
    over `messages` writes nothing that depends on them; the generation prompt is all it writes after the loop.
    (prepare.ChatRenderer keeps the answer with the compiled template.)"""
    try:
        return _check(env.parse(source))
    except Exception:  # a template jinja cannot parse: the per-prefix path reports it
        return False


def _check(tree: nodes.Template) -> bool:
    if any(True for _ in tree.find_all(UNSEEN)):
        return False
    loops = [k for k, n in enumerate(tree.body) if isinstance(n, nodes.For)]
    if len(loops) != 1:
        return False
    k = loops[0]
    loop, before, after = tree.body[k], tree.body[:k], tree.body[k + 1:]
    # `{% set loop_messages = messages %}` before the loop (Llama-3's): that name is the messages too.
    aliases = [n for n in before if isinstance(n, nodes.Assign) and isinstance(n.target, nodes.Name)
               and isinstance(n.node, nodes.Name) and n.node.name == "messages"]
    seq = frozenset({"messages", *(a.target.name for a in aliases)})
    stored = [n.name for n in tree.find_all(nodes.Name) if n.ctx in ("store", "param") and n.name in seq]
    if len(stored) != len(aliases):  # an alias (or `messages`) set anywhere else
        return False
    if not (isinstance(loop.iter, nodes.Name) and loop.iter.name in seq and not loop.else_
            and loop.test is None and not loop.recursive):
        return False
    if any(_names(n) & (seq | {"add_generation_prompt"}) for n in before if not any(n is a for a in aliases)):
        return False
    if not all(_looks_back(n, True, seq) for n in [loop.target, *loop.body]):
        return False
    if not after:
        return True
    prompt = after[0]
    if len(after) > 1 or not (isinstance(prompt, nodes.If) and isinstance(prompt.test, nodes.Name)
                              and prompt.test.name == "add_generation_prompt" and not prompt.elif_ and not prompt.else_):
        return False
    # The generation prompt from variables only: no name the template sets (a namespace the loop filled, a macro).
    return not (_names(prompt) & (_assigned(tree) | seq | {"loop"}))


def _names(node: nodes.Node) -> set[str]:
    return {n.name for n in node.find_all(nodes.Name)}


def _assigned(tree: nodes.Template) -> set[str]:
    out = {n.name for n in tree.find_all(nodes.Name) if n.ctx in ("store", "param")}
    out |= {n.name for n in tree.find_all(nodes.NSRef)}
    out |= {n.name for n in tree.find_all(nodes.Macro)}
    return out


def _looks_back(node: nodes.Node, outer: bool, seq: frozenset) -> bool:
    """`node`, inside the message loop, reads the messages (`seq`: their names) only as messages[0], no generation
    prompt, and of the message loop's `loop` only BACKWARD attributes (`outer`: that `loop` is the message loop's,
    not a nested one's)."""
    if isinstance(node, nodes.Getitem) and isinstance(node.node, nodes.Name) and node.node.name in seq:
        return isinstance(node.arg, nodes.Const) and node.arg.value == 0
    if isinstance(node, nodes.Getattr) and isinstance(node.node, nodes.Name) and node.node.name == "loop" and outer:
        return node.attr in BACKWARD
    if isinstance(node, nodes.Name):
        return node.name not in seq and node.name != "add_generation_prompt" and not (outer and node.name == "loop")
    if isinstance(node, nodes.For):  # its own `loop` inside its body; its iterable is read in this scope
        return (all(_looks_back(n, outer, seq) for n in (node.target, node.iter))
                and (node.test is None or _looks_back(node.test, False, seq))
                and all(_looks_back(n, False, seq) for n in [*node.body, *node.else_]))
    return all(_looks_back(child, outer, seq) for child in node.iter_child_nodes())


class Marked:
    """The messages of one rendering, noting how much the template has written when it takes each one (and when its
    loop ends): `written` is the count kept by whoever drives the rendering."""

    __slots__ = ("items", "written", "marks")

    def __init__(self, items: list, written: list[int]):
        self.items, self.written, self.marks = items, written, []

    def __iter__(self):
        for item in self.items:
            self.marks.append(self.written[0])
            yield item
        self.marks.append(self.written[0])

    def __getitem__(self, k):
        return self.items[k]


def layout(render_pieces, messages: list[dict], seen: list[dict]):
    """(full, spans) as prepare.chat_layout gives them, from one rendering with the generation prompt;
    render_pieces(messages) -> the template's output pieces. None where it cannot be had this way."""
    if messages[0]["role"] == "assistant":  # its context is cut at a marker (prepare._before_first)
        return None
    written = [0]
    marked = Marked(seen, written)
    out = []
    try:
        for piece in render_pieces(marked):
            out.append(piece)
            written[0] += len(piece)
    except Exception:  # the per-prefix renderings raise it, naming the record, as they always did
        return None
    n = len(seen)
    if len(marked.marks) != n + 1:
        return None
    text = "".join(out)
    marks = marked.marks
    prompt = text[marks[n]:]
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        # The context (i messages and the generation prompt) must start the rendering through the turn.
        if marks[i] + len(prompt) > marks[i + 1] or text[marks[i]:marks[i] + len(prompt)] != prompt:
            return None
        spans.append((marks[i] + len(prompt), marks[i + 1]))
    return text[:marks[n]], spans
