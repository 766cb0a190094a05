"""``tern chat``: talk to a model from the terminal, like ``ollama run``.

Interactive on a terminal (streamed answers, the conversation kept between turns, ``/system``,
``/clear``, ``/exit``); one-shot when stdin is a pipe (``echo "hi" | tern chat``) or a prompt is
given as an argument. It talks the OpenAI API with httpx (a runtime dependency; the ``openai``
package is not), to the gateway of the ``tern up`` stack with its demo key by default, or to any
``--url``: another gateway with ``--api-key``, or an engine directly (engines need no key).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import httpx

from tern_cli.errors import CliError
from tern_cli.local_stack import LocalStack

DEFAULT_URL = "http://127.0.0.1:8000"
API_KEY_ENV = "TERN_API_KEY"
HELP = """Commands:
  /system TEXT   set the system prompt (and start a new conversation)
  /clear         forget the conversation (the system prompt stays)
  /exit, /bye    leave (Ctrl-D too)
  /help          this text
Ctrl-C stops an answer early."""


@dataclass
class Conversation:
    """What is sent each turn: the system prompt, then every question and answer so far."""

    system: str | None = None
    turns: list[dict[str, str]] = field(default_factory=list)

    def messages(self, question: str) -> list[dict[str, str]]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return [*system, *self.turns, {"role": "user", "content": question}]

    def remember(self, question: str, answer: str) -> None:
        self.turns += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]

    def clear(self) -> None:
        self.turns.clear()


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    seconds: float

    def line(self) -> str:
        rate = self.completion_tokens / self.seconds if self.seconds > 0 else 0.0
        return (
            f"[{self.prompt_tokens} prompt tokens, {self.completion_tokens} completion tokens, "
            f"{rate:.1f} tokens/s]"
        )


def _error_message(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return f"HTTP {response.status_code} {response.text[:200]}"


class ChatClient:
    """The two OpenAI calls ``tern chat`` makes, over one httpx connection pool."""

    def __init__(self, url: str, api_key: str | None, *, timeout_s: float = 600.0) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.url = url.rstrip("/")
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s)
        self.last_usage: Usage | None = None

    def close(self) -> None:
        self.http.close()

    def first_model(self) -> str:
        response = self._call("GET", "/v1/models")
        models = response.json().get("data") or []
        if not models:
            raise CliError(f"{self.url} serves no model right now (is the engine still loading?)")
        return str(models[0]["id"])

    def stream(self, model: str, messages: list[dict[str, str]], options: dict[str, Any]) -> Iterator[str]:
        """The answer's text, piece by piece as the server streams it."""
        body = {
            "model": model,
            "messages": messages,
            "stream": True,
            "stream_options": {"include_usage": True},
            **options,
        }
        self.last_usage = None
        started = time.perf_counter()
        try:
            with self.http.stream("POST", "/v1/chat/completions", json=body) as response:
                if response.status_code != 200:
                    response.read()
                    raise CliError(_error_message(response))
                for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line.removeprefix("data: "))
                    if "error" in event:
                        raise CliError(str(event["error"].get("message") or event["error"]))
                    if event.get("usage"):
                        usage = event["usage"]
                        elapsed = time.perf_counter() - started
                        self.last_usage = Usage(usage["prompt_tokens"], usage["completion_tokens"], elapsed)
                    for choice in event.get("choices") or []:
                        text = (choice.get("delta") or {}).get("content")
                        if text:
                            yield text
        except httpx.HTTPError as exc:
            raise CliError(f"cannot talk to {self.url}: {exc}") from exc

    def _call(self, method: str, path: str) -> httpx.Response:
        try:
            response = self.http.request(method, path)
        except httpx.HTTPError as exc:
            raise CliError(f"cannot reach {self.url} ({exc}); is the stack running (`make up`)?") from exc
        if response.status_code != 200:
            raise CliError(f"{self.url}{path}: {_error_message(response)}")
        return response


@dataclass
class Chat:
    """One session: the client, the model, the conversation, and where the answers go."""

    client: ChatClient
    model: str
    conversation: Conversation
    options: dict[str, Any]
    out: TextIO
    verbose: bool = False

    def ask(self, question: str) -> None:
        """Stream one answer; remember the exchange unless it was cut short."""
        pieces: list[str] = []
        try:
            for piece in self.client.stream(self.model, self.conversation.messages(question), self.options):
                pieces.append(piece)
                self.out.write(piece)
                self.out.flush()
        except KeyboardInterrupt:
            self.out.write("\n[stopped]\n")
            return
        finally:
            if pieces and not "".join(pieces).endswith("\n"):
                self.out.write("\n")
            self.out.flush()
        self.conversation.remember(question, "".join(pieces))
        if self.verbose and self.client.last_usage is not None:
            print(self.client.last_usage.line(), file=sys.stderr, flush=True)

    def command(self, line: str) -> bool:
        """Run a ``/command``; False means leave."""
        name, _, rest = line.partition(" ")
        if name in ("/exit", "/bye", "/quit"):
            return False
        if name == "/clear":
            self.conversation.clear()
            print("(conversation cleared)", file=sys.stderr, flush=True)
        elif name == "/system":
            self.conversation.system = rest.strip() or None
            self.conversation.clear()
            shown = "cleared" if self.conversation.system is None else "set"
            print(f"(system prompt {shown}; new conversation)", file=sys.stderr, flush=True)
        elif name in ("/help", "/?"):
            print(HELP, file=sys.stderr, flush=True)
        else:
            print(f"unknown command {name}; /help lists them", file=sys.stderr, flush=True)
        return True

    def repl(self, lines: Iterator[str]) -> None:
        for raw in lines:
            line = raw.strip()
            if not line:
                continue
            if line.startswith("/"):
                if not self.command(line):
                    return
                continue
            try:
                self.ask(line)
            except CliError as error:  # one failed turn does not end the session
                print(f"tern: error: {error}", file=sys.stderr, flush=True)


def terminal_lines(prompt: str) -> Iterator[str]:
    """Lines typed at a terminal, with line editing; ends on Ctrl-D."""
    import contextlib

    with contextlib.suppress(ImportError):
        import readline  # noqa: F401  (input() gains history and editing)
    while True:
        try:
            yield input(prompt)
        except EOFError:
            print(file=sys.stderr)
            return
        except KeyboardInterrupt:
            print("\nUse Ctrl-D or /exit to leave.", file=sys.stderr, flush=True)


def add_parser(commands: Any) -> None:
    chat = commands.add_parser(
        "chat",
        help="chat with a model in the terminal (the local stack's, by default)",
        description=__doc__.split("\n\n")[1].replace("\n", " ") if __doc__ else None,
    )
    chat.add_argument("prompt", nargs="*", help="ask this once and exit (else stdin: a pipe is one question)")
    chat.add_argument(
        "--url", help=f"a gateway or an engine (default: the local stack's, else {DEFAULT_URL})"
    )
    chat.add_argument(
        "--api-key", help=f"default: {API_KEY_ENV}, else the local stack's demo key (engines need none)"
    )
    chat.add_argument("--model", help="default: the first model the server lists")
    chat.add_argument("--system", help="a system prompt")
    chat.add_argument("--max-tokens", type=int)
    chat.add_argument("--temperature", type=float)
    chat.add_argument("--verbose", action="store_true", help="after each answer, token counts and speed")
    chat.add_argument(
        "--interactive", action="store_true", help="keep reading questions from stdin even when it is a pipe"
    )
    chat.add_argument("--data-dir", type=Path, metavar="DIR", help="the `tern up` stack (default: .tern)")
    chat.set_defaults(run=cmd_chat)


def _connection(args: argparse.Namespace) -> tuple[str, str | None]:
    """The URL and key to use: flags, then the environment, then the local stack."""
    stack = LocalStack.find(args.data_dir)
    url = args.url or stack.gateway_url()
    if url is None:
        if args.data_dir is not None:
            raise CliError(f"no running stack in {stack.data_dir}; start it with `tern up` or pass --url")
        url = DEFAULT_URL
    key = args.api_key or os.environ.get(API_KEY_ENV)
    if key is None and args.url is None:
        key = stack.read("demo_key")
    return url, key


def cmd_chat(args: argparse.Namespace) -> int:
    url, key = _connection(args)
    client = ChatClient(url, key)
    try:
        options = {
            name: value
            for name, value in (("max_tokens", args.max_tokens), ("temperature", args.temperature))
            if value is not None
        }
        chat = Chat(
            client=client,
            model=args.model or client.first_model(),
            conversation=Conversation(system=args.system),
            options=options,
            out=sys.stdout,
            verbose=args.verbose,
        )
        if args.prompt:
            chat.ask(" ".join(args.prompt))
        elif sys.stdin.isatty():
            print(
                f"Chatting with {chat.model} at {url}. /help for commands, Ctrl-D to leave.", file=sys.stderr
            )
            chat.repl(terminal_lines(">>> "))
        elif args.interactive:
            chat.repl(iter(sys.stdin))
        else:
            question = sys.stdin.read().strip()
            if not question:
                raise CliError("nothing to ask: stdin was empty")
            chat.ask(question)
        return 0
    finally:
        client.close()
