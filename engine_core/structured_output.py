"""Structured output (JSON schema, JSON object, regex, choice, EBNF grammar) with xgrammar.

A request with ``SamplingParams.structured_output`` starts blocked on its grammar
(WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR, set by the Request constructor). Its grammar compiles on a
thread pool, off the busy loop; ``poll`` then promotes the request (or fails it with the compile
error; requests with the same spec share one compile). Each pass, ``bitmask`` packs, for every
structured request that samples in it, the tokens its grammar allows next (32 tokens per int32,
xgrammar's layout), and the model runner masks the others before sampling. ``accept`` advances a
request's matcher by the tokens it produced; a token its grammar refuses fails the request. A
complete grammar allows only the model's EOS ids, so the request ends the usual way (once its EOS
is accepted, the grammar constrains nothing more).

Speculative decoding, as vLLM's: a structured request's draft tokens are cut before the first one
its grammar refuses (``validate_tokens``, before the scheduler gets them), and its pass then has a
row per position it samples: after its last known token and after each draft, the matcher advanced
through the drafts to fill them and rolled back after (xgrammar's matchers roll back without limit
since 0.2; the engine pins 0.2.9). Only the tokens the pass keeps advance the matcher (``accept``).

The spec is a dict with exactly one constraint: ``json`` (a schema, dict or string),
``json_object`` (any JSON object), ``regex``, ``choice`` (a list of strings), ``grammar`` (EBNF) or
``structural_tag`` (xgrammar's structural tag, dict or JSON string: free text in which each
trigger opens a tagged structure, e.g. a tool call's JSON; vLLM's older form, ``structures`` of
begin/schema/end with ``triggers``, too); and optionally vLLM's ``disable_any_whitespace`` (JSON
without optional whitespace).
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from engine_core.sched.output import GrammarBitmask

logger = logging.getLogger(__name__)

STRUCTURED_OUTPUT_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
STRUCTURED_OUTPUT_OPTIONS = ("disable_any_whitespace",)


# Objects and arrays nested in a JSON schema, at most (64 levels of nested properties).
MAX_SCHEMA_DEPTH = 128


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether JSON ``value`` nests objects and arrays more than ``limit`` deep (without recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


def check_structured_output(spec: Any) -> None:
    """Raise ValueError unless ``spec`` is a well-formed structured-output request (the grammar
    itself is checked too, without a tokenizer, so a bad schema is the client's error up front)."""
    try:
        import xgrammar as xgr
    except ImportError as e:
        raise ValueError("structured output needs the xgrammar package (pip install --no-deps xgrammar)") from e

    kinds = [k for k in spec if k in STRUCTURED_OUTPUT_KINDS] if isinstance(spec, dict) else []
    if len(kinds) != 1:
        raise ValueError(f"structured output takes exactly one of {', '.join(STRUCTURED_OUTPUT_KINDS)}")
    unknown = [k for k in spec if k not in STRUCTURED_OUTPUT_KINDS and k not in STRUCTURED_OUTPUT_OPTIONS]
    if unknown:
        raise ValueError(f"unsupported structured output option(s): {', '.join(map(str, unknown))}")
    if not isinstance(spec.get("disable_any_whitespace", False), bool):
        raise ValueError("disable_any_whitespace must be true or false")
    kind = kinds[0]
    value = spec[kind]
    try:
        if kind == "json":
            if not isinstance(value, dict | str):
                raise ValueError("a JSON schema must be an object or a string")
            try:
                schema = json.loads(value) if isinstance(value, str) else value
            except RecursionError:
                schema = None
            if schema is None or _deeper_than(schema, MAX_SCHEMA_DEPTH):
                # (Its compile time grows fast with depth: 600 levels took 8 s, holding the router's
                # event loop and the engine's compile thread; real schemas are a few levels deep.)
                raise ValueError(f"the JSON schema is nested more than {MAX_SCHEMA_DEPTH} levels deep")
            xgr.Grammar.from_json_schema(value if isinstance(value, str) else json.dumps(value))
            unenforced = unenforced_schema_keyword(schema)
            if unenforced is not None:
                raise ValueError(f"the JSON schema's {unenforced} cannot be enforced while generating (the "
                                 "answer could break it); leave it out of the schema and check it afterwards")
        elif kind == "json_object":
            if value is not True:
                raise ValueError("json_object must be true")
        elif kind == "regex":
            if not isinstance(value, str):
                raise ValueError("a regex must be a string")
            xgr.Grammar.from_regex(value)
        elif kind == "choice":
            if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
                raise ValueError("choice must be a non-empty list of strings")
            xgr.Grammar.from_ebnf(choice_grammar(value))
        elif kind == "structural_tag":
            tag = structural_tag_value(value)
            if _deeper_than(tag, MAX_SCHEMA_DEPTH):
                raise ValueError(f"the structural tag is nested more than {MAX_SCHEMA_DEPTH} levels deep")
            for where, schema in _structural_tag_schemas(tag):
                unenforced = unenforced_schema_keyword(schema)
                if unenforced is not None:
                    raise ValueError(f"the JSON schema of {where}: its {unenforced} cannot be enforced while "
                                     "generating (the answer could break it); leave it out and check it afterwards")
            _structural_tag_grammar(xgr, tag)
        else:
            if not isinstance(value, str):
                raise ValueError("a grammar must be an EBNF string")
            xgr.Grammar.from_ebnf(value)
    except RuntimeError as e:  # xgrammar's parse errors (and its invalid structural tag error)
        raise ValueError(f"invalid {kind}: {_first_line(str(e))}") from e


def structural_tag_value(value: Any) -> dict[str, Any]:
    """A structural tag as given (a dict, or vLLM's JSON string), as a dict; ValueError if neither."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (json.JSONDecodeError, RecursionError):
            raise ValueError("a structural tag must be a JSON object (or a string of one)") from None
    if not isinstance(value, dict):
        raise ValueError("a structural tag must be a JSON object (or a string of one)")
    return value


def _is_legacy_structural_tag(tag: dict[str, Any]) -> bool:
    """vLLM's older form: {"structures": [{"begin", "schema", "end"}], "triggers": [...]}."""
    return "structures" in tag


def _structural_tag_schemas(tag: dict[str, Any]) -> list[tuple[str, Any]]:
    """The JSON schemas a structural tag holds, each with where it is."""
    if _is_legacy_structural_tag(tag):
        structures = tag.get("structures")
        return [(f"structure {s.get('begin')!r}", s.get("schema")) for s in structures if isinstance(s, dict)
                ] if isinstance(structures, list) else []
    found: list[tuple[str, Any]] = []
    stack: list[Any] = [tag]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if item.get("type") == "json_schema" and "json_schema" in item:
                found.append(("a json_schema format", item["json_schema"]))
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return found


def _structural_tag_grammar(xgr: Any, tag: dict[str, Any], compiler: Any = None) -> Any:
    """The tag's grammar (``compiler``: compiled with it; else only built, to check it)."""
    if _is_legacy_structural_tag(tag):
        structures, triggers = tag.get("structures"), tag.get("triggers")
        if (not isinstance(structures, list) or not all(isinstance(s, dict) for s in structures)
                or not isinstance(triggers, list) or not all(isinstance(t, str) for t in triggers)):
            raise ValueError("a structural tag's structures must be a list of objects and its triggers a list of "
                             "strings")
        try:
            items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                     for s in structures]
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"each structure needs begin, schema and end ({e})") from None
        args: tuple[Any, ...] = (items, triggers)
    else:
        args = (json.dumps(tag),)
    if compiler is not None:
        return compiler.compile_structural_tag(*args)
    return xgr.Grammar.from_structural_tag(*args)


def _first_line(message: str) -> str:
    # xgrammar prefixes "[time] file:line: " to its C++ errors.
    line = message.strip().splitlines()[0] if message.strip() else message
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", line)


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar matching exactly one of ``choices``, each a string literal (xgrammar's EBNF
    takes JSON's escapes; an empty choice is the empty literal, which a regex alternation refused)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


# Schema keywords the grammar cannot hold the answer to: xgrammar compiles them but generates as if
# they were absent (or, for a length beside a pattern, drops the length), so an answer could break
# the schema. Such schemas are refused (vLLM refuses a similar list for its xgrammar backend).
_UNENFORCED_KEYWORDS = ("contains", "minContains", "maxContains", "not", "if", "then", "else",
                        "dependentRequired", "dependentSchemas", "dependencies")
_ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$comment", "deprecated", "readOnly",
                          "writeOnly", "$defs", "definitions", "$schema", "$id"})
# Where subschemas sit: one schema, a list of them, or a map of names to them.
_SUBSCHEMA = ("items", "additionalProperties", "propertyNames", "unevaluatedProperties", "unevaluatedItems",
              "additionalItems", "contains", "not", "if", "then", "else")
_SUBSCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf", "items")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


_BOUNDS = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})


def _types(schema: dict[str, Any]) -> set[str]:
    kind = schema.get("type")
    return {kind} if isinstance(kind, str) else set(kind) if isinstance(kind, list) else {"number"}


def unenforced_schema_keyword(schema: Any, path: str = "") -> str | None:
    """The first keyword of a JSON schema (with where it is) that generation cannot enforce; None
    when it has none. Only subschemas are searched (a property named "not" is no keyword)."""
    if not isinstance(schema, dict):
        return None
    where = f" (at {path or '/'})"
    for keyword in _UNENFORCED_KEYWORDS:
        if keyword in schema:
            return f"{keyword!r}{where}"
    if schema.get("uniqueItems") is True:
        return f"'uniqueItems'{where}"
    if "multipleOf" in schema and (_types(schema) - {"integer", "null"} or _BOUNDS & set(schema)):
        # (held only for an integer without bounds)
        return f"'multipleOf' on a number or beside bounds{where}"
    if ("minLength" in schema or "maxLength" in schema) and "pattern" in schema:
        return f"length limit beside a pattern{where}"
    if "format" in schema and schema.get("minLength", 0) > 1:
        # (A format's match is never empty, so a minLength of 1 holds; a maxLength beside a format is
        # not held, as with pydantic's HttpUrl: 2083, which no generated URL comes near.)
        return f"minLength beside a format{where}"
    all_of = schema.get("allOf")
    if isinstance(all_of, list) and (len(all_of) > 1 or set(schema) - _ANNOTATIONS - {"allOf"}):
        return f"'allOf' of several schemas or beside other keywords{where}"  # (a lone wrapped $ref is fine)
    for key in _SUBSCHEMA:
        found = unenforced_schema_keyword(schema.get(key), f"{path}/{key}")
        if found:
            return found
    for key in _SUBSCHEMA_LISTS:
        for i, sub in enumerate(schema.get(key) if isinstance(schema.get(key), list) else ()):
            found = unenforced_schema_keyword(sub, f"{path}/{key}/{i}")
            if found:
                return found
    for key in _SUBSCHEMA_MAPS:
        for name, sub in (schema.get(key) or {}).items() if isinstance(schema.get(key), dict) else ():
            found = unenforced_schema_keyword(sub, f"{path}/{key}/{name}")
            if found:
                return found
    return None


class StructuredOutputManager:
    """The engine's grammars: compiled grammars (cached by spec), one matcher per live request."""

    def __init__(self, load_tokenizer: Callable[[], Any], vocab_size: int, eos_token_ids: tuple[int, ...],
                 max_threads: int = 2, cache_size: int = 128, compile_workers: int | None = None) -> None:
        # xgrammar and the tokenizer load on a compile thread, with the first grammar (seconds of
        # imports the busy loop must not wait for).
        self._load_tokenizer = load_tokenizer
        self._xgr: Any = None
        self._compiler: Any = None
        self._setup_lock = threading.Lock()
        self._max_threads = max_threads
        # The model's logits size (may exceed the tokenizer's); the model's EOS ids end a finished grammar.
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        # Several compiles at once (half the cores, as vLLM's pool): a large schema that takes seconds
        # does not hold up every other request's grammar behind it. (xgrammar's compiler is shared by
        # the threads; the first compile sets it up, the others wait for that.)
        workers = compile_workers if compile_workers is not None else max(1, min(8, (os.cpu_count() or 2) // 2))
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grammar-compile")
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self._cache_size = cache_size
        self._pending: dict[str, tuple[str, Future]] = {}
        # Compiles under way, by spec: requests with the same spec share one.
        self._compiling: dict[str, Future] = {}
        self._matchers: dict[str, Any] = {}
        # Requests whose grammar starts after a token sequence: (the sequence, the last tokens seen).
        self._starts_after: dict[str, tuple[list[int], list[int]]] = {}
        # Requests whose first token may open a wait instead: (that token, the sequence then awaited).
        self._may_open: dict[str, tuple[int, list[int]]] = {}
        # Requests whose grammar, once its start sequence is seen, waits further for this token.
        self._then: dict[str, int] = {}

    # -- requests -------------------------------------------------------------------------------

    def submit(self, request_id: str, spec: dict[str, Any], starts_after: list[int] | None = None,
               may_open: int | None = None, then: int | None = None) -> None:
        """Start compiling the request's grammar (a cached one is ready at the next ``poll``).
        ``starts_after``: the grammar constrains only what follows the first time the output ends
        with these tokens (a reasoning model thinks freely first). With ``may_open``, only if the
        output's first token is that one (it opens the thinking); otherwise the grammar holds from
        the first token, which may be ``may_open`` or one the grammar allows. ``then``: after the
        sequence, the grammar waits further for this token (tokens may come between)."""
        if starts_after and then is not None:
            self._then[request_id] = then
        if starts_after and may_open is not None:
            self._may_open[request_id] = (may_open, list(starts_after))
        elif starts_after:
            self._starts_after[request_id] = (list(starts_after), [])
        key = json.dumps(spec, sort_keys=True)
        future = self._compiling.get(key)
        if future is None:
            future = Future()
            if key in self._compiled:
                self._compiled.move_to_end(key)
                future.set_result(self._compiled[key])
            else:
                future = self._compiling[key] = self._pool.submit(self._compile, spec)
        self._pending[request_id] = (key, future)

    def _set_up(self) -> None:
        """xgrammar and its view of the tokenizer, once (on the first compile's thread)."""
        with self._setup_lock:
            if self._compiler is not None:
                return
            import xgrammar as xgr

            tokenizer = self._load_tokenizer()
            # The model's EOS ids and the tokenizer's (a request's own EOS): a complete grammar allows each.
            stop_ids = list(dict.fromkeys([*self.eos_token_ids, *(
                [tokenizer.eos_token_id] if isinstance(getattr(tokenizer, "eos_token_id", None), int) else [])]))
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=stop_ids or None)
            # Our bounded cache (by spec) is the one cache: xgrammar's own would keep every grammar.
            self._xgr = xgr
            self._compiler = xgr.GrammarCompiler(info, max_threads=self._max_threads, cache_enabled=False)

    def _compile(self, spec: dict[str, Any]) -> Any:
        if self._compiler is None:
            self._set_up()
        kind = next(k for k in spec if k in STRUCTURED_OUTPUT_KINDS)
        value = spec[kind]
        any_whitespace = not spec.get("disable_any_whitespace", False)
        if kind == "json":
            return self._compiler.compile_json_schema(value if isinstance(value, str) else json.dumps(value),
                                                      any_whitespace=any_whitespace)
        if kind == "json_object":  # an object, as OpenAI promises (xgrammar's builtin JSON takes any value)
            return self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=any_whitespace)
        if kind == "regex":
            return self._compiler.compile_regex(value)
        if kind == "choice":
            return self._compiler.compile_grammar(choice_grammar(value))
        if kind == "structural_tag":
            return _structural_tag_grammar(self._xgr, structural_tag_value(value), self._compiler)
        return self._compiler.compile_grammar(value)

    def poll(self) -> tuple[list[str], list[tuple[str, str]]]:
        """Requests whose grammar is now ready (they get a matcher), and (request, error) pairs for
        grammars that failed to compile."""
        ready, failed = [], []
        for request_id, (key, future) in list(self._pending.items()):
            if not future.done():
                continue
            del self._pending[request_id]
            if self._compiling.get(key) is future:
                del self._compiling[key]
            try:
                compiled = future.result()
            except Exception as e:
                self._starts_after.pop(request_id, None)
                self._may_open.pop(request_id, None)
                self._then.pop(request_id, None)
                failed.append((request_id, f"structured output: {_first_line(str(e))}"))
                continue
            self._compiled[key] = compiled
            self._compiled.move_to_end(key)
            while len(self._compiled) > self._cache_size:
                self._compiled.popitem(last=False)
            self._matchers[request_id] = self._xgr.GrammarMatcher(compiled)
            ready.append(request_id)
        return ready, failed

    def has_pending(self) -> bool:
        return bool(self._pending)

    def has_matchers(self) -> bool:
        return bool(self._matchers)

    def remove(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
        self._starts_after.pop(request_id, None)
        self._may_open.pop(request_id, None)
        self._then.pop(request_id, None)
        entry = self._pending.pop(request_id, None)
        if entry is not None and not any(future is entry[1] for _, future in self._pending.values()):
            entry[1].cancel()  # (nobody else waits for it)
            if self._compiling.get(entry[0]) is entry[1]:
                del self._compiling[entry[0]]

    def clear(self) -> None:
        for request_id in list(self._pending) + list(self._matchers) + list(self._starts_after):
            self.remove(request_id)

    # -- each pass ------------------------------------------------------------------------------

    def bitmask(self, scheduled_request_ids: Any, spec_tokens: Mapping[str, list[int]] | None = None
                ) -> tuple[GrammarBitmask | None, list[tuple[str, str]]]:
        """The allowed-token rows of the scheduled requests that have a live matcher (None if none),
        and (request, error) pairs for matchers that failed (those requests must be failed). A
        request with draft tokens (``spec_tokens``, as scheduled) has a row per position its pass
        samples: after its last known token, then after each draft (vLLM's ``grammar_bitmask``).
        Where its grammar does not hold, the row allows every token: a finished grammar (its EOS
        accepted) constrains nothing, as in vLLM, nor does one before its start sequence. A request
        with no row its grammar holds gets none."""
        spec_tokens = spec_tokens or {}
        # (Without drafts, a request before its grammar's start or after its end has no row: left out
        # before any is filled.)
        ids = [r for r in scheduled_request_ids if r in self._matchers and (
            r in spec_tokens or (r not in self._starts_after and not self._matchers[r].is_terminated()))]
        if not ids:
            return None, []
        bitmask = self._xgr.allocate_token_bitmask(sum(1 + len(spec_tokens.get(r, ())) for r in ids),
                                                   self.vocab_size)
        kept, num_rows, failed = [], [], []
        at = 0  # (the next request's first row: a request left out is written over)
        for request_id in ids:
            try:
                holds = self._fill_rows(request_id, spec_tokens.get(request_id, []), bitmask, at)
            except Exception as e:
                failed.append((request_id, f"structured output: {_first_line(str(e))}"))
                self.remove(request_id)
                continue
            if not any(holds):
                continue
            opening = self._may_open.get(request_id)
            if opening is not None and holds[0]:  # (the first token may open the thinking instead)
                word, bit = divmod(opening[0], 32)
                value = int(bitmask[at, word]) | (1 << bit)
                bitmask[at, word] = value - (1 << 32) if value >= 1 << 31 else value  # (as an int32)
            kept.append(request_id)
            num_rows.append(len(holds))
            at += len(holds)
        if not kept:
            return None, failed
        rows = bitmask[:at].numpy()
        return GrammarBitmask(kept, rows.shape[1], rows.tobytes(), num_rows), failed

    def _fill_rows(self, request_id: str, drafts: list[int], bitmask: Any, first_row: int) -> list[bool]:
        """Fill the request's rows from ``first_row`` on (1 + its drafts); whether its grammar holds
        at each (a row where it does not allows every token)."""
        matcher = self._matchers[request_id]
        holds: list[bool] = []

        def fill(j: int, grammar_holds: bool) -> None:
            if grammar_holds:
                matcher.fill_next_token_bitmask(bitmask, first_row + j)
            else:
                bitmask[first_row + j] = -1
            holds.append(grammar_holds)

        if self._walk(request_id, drafts, fill) < len(drafts):  # (validate_tokens cut them: a bug)
            raise ValueError("a scheduled draft token does not fit the grammar")
        return holds

    def validate_tokens(self, request_id: str, token_ids: list[int]) -> list[int]:
        """A structured request's draft tokens up to the first one its grammar refuses (vLLM's
        ``validate_tokens``); the matcher is left as it was. Before a grammar's start sequence every
        token passes (the thinking is free); after a finished grammar none does. A request without a
        matcher keeps its draft."""
        if request_id not in self._matchers or not token_ids:
            return token_ids
        if request_id in self._may_open:
            return []  # (its first token is still to come: nothing is drafted before it)
        return token_ids[:self._walk(request_id, token_ids)]

    def _walk(self, request_id: str, token_ids: list[int],
              visit: Callable[[int, bool], None] | None = None) -> int:
        """Advance the request's grammar state through ``token_ids`` as ``accept`` would, up to the
        first token it refuses, then back (the matcher rolled back, the start sequence's progress
        untouched). Returns how many tokens it took. ``visit(j, holds)`` is called at each position
        reached, with the matcher as it stands after j tokens: before each token and after the last
        one taken; ``holds``: the grammar constrains that position (its start sequence seen, and
        it is not finished)."""
        matcher = self._matchers[request_id]
        waiting = self._starts_after.get(request_id)
        sequence, seen = (waiting[0], list(waiting[1])) if waiting is not None else (None, [])
        then = self._then.get(request_id)
        taken = advanced = 0
        try:
            for token in token_ids:
                if visit is not None:
                    visit(taken, sequence is None and not matcher.is_terminated())
                if sequence is not None:  # still before the grammar's start
                    seen.append(token)
                    del seen[:-len(sequence)]
                    if seen == sequence:
                        sequence, seen, then = ([then], [], None) if then is not None else (None, [], None)
                elif matcher.is_terminated() or not matcher.accept_token(token):
                    return taken
                else:
                    advanced += 1
                taken += 1
            if visit is not None:
                visit(taken, sequence is None and not matcher.is_terminated())
            return taken
        finally:
            if advanced:
                matcher.rollback(advanced)

    def accept(self, request_id: str, token_ids: list[int]) -> str | None:
        """Advance the request's matcher; an error message when a token does not fit its grammar
        (only possible when other constraints left the grammar no token: the request must fail)."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return None
        opening = self._may_open.pop(request_id, None) if token_ids else None
        if opening is not None and token_ids[0] == opening[0]:
            # The answer opened its thinking: the grammar waits for its end.
            self._starts_after[request_id] = (opening[1], [])
            token_ids = token_ids[1:]
        waiting = self._starts_after.get(request_id)
        for token in token_ids:
            if waiting is not None:  # still before the grammar's start: watch for the sequence
                sequence, seen = waiting
                seen.append(token)
                del seen[:-len(sequence)]
                if seen == sequence:
                    then = self._then.pop(request_id, None)
                    if then is None:
                        del self._starts_after[request_id]
                        waiting = None
                    else:  # (the sequence seen: now its token)
                        waiting = self._starts_after[request_id] = ([then], [])
                continue
            if matcher.is_terminated():
                break  # (the EOS that ended the grammar was accepted; nothing follows it)
            if not matcher.accept_token(token):
                self.remove(request_id)
                return (f"structured output: token {token} does not fit the grammar (its other sampling "
                        "constraints left the grammar no allowed token)")
        return None

    def is_structured(self, request_id: str) -> bool:
        return request_id in self._matchers or request_id in self._pending

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
