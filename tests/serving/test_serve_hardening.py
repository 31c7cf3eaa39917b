"""`dgemma serve` under hostile clients (issue 21): slow bodies, requests for unbounded work, large prompts, empty
keys, cross-site and DNS-rebinding requests, JSON and chat templates that used to raise 500s, and a bounded fuzz of
malformed HTTP. Real uvicorn servers on free 127.0.0.1 ports over a real engine and a tiny random model; raw sockets
where a client must misbehave."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import pre_tokenizers

from dgemma import cli
from dgemma.data.templates import ChatTemplate
from dgemma.data.tokenizer import build_test_tokenizer
from dgemma.sampling.generation_config import GenerationConfig
from dgemma.serving.api import Limits
from dgemma.serving.app import create_app
from dgemma.serving.engine import Engine
from dgemma.serving.guards import allowed_hosts
from tests.helpers import random_init_model, running_server

JSON = {"Content-Type": "application/json"}
USER = [{"role": "user", "content": "Hi"}]
LIMITS = Limits(max_n=2, max_canvas_passes=8, max_request_steps=64)


@pytest.fixture(scope="module")
def model():
    return random_init_model()


@pytest.fixture(scope="module")
def tok():
    return build_test_tokenizer(512)


@pytest.fixture(scope="module")
def base(model) -> GenerationConfig:
    return GenerationConfig.for_model(model.config).replace(max_denoising_steps=2, eos_token_id=(), max_new_tokens=16)


@pytest.fixture(scope="module")
def engine(model):
    with Engine(model, max_batch=4, max_context=256, impl="reference") as e:
        yield e


@pytest.fixture(scope="module")
def server(engine, tok, base):
    """No key, bound to 127.0.0.1, so only loopback Host names are answered; short body timeout; small caps."""
    app = create_app(engine, tok, "tiny", generation_config=base, limits=LIMITS, body_timeout=0.25,
                     max_request_bytes=64 * 1024, allowed_hosts=allowed_hosts("127.0.0.1", None))
    with running_server(app) as url:
        yield url


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def raw(url: str, data: bytes, timeout: float = 5.0) -> tuple[bytes, bool]:
    """Send `data` on a fresh connection and read until the server closes it or `timeout` passes: (what was read,
    whether the server closed the connection)."""
    with socket.create_connection(("127.0.0.1", port_of(url)), timeout=timeout) as s:
        with contextlib.suppress(OSError):
            s.sendall(data)
        out, closed = b"", False
        try:
            while chunk := s.recv(65536):
                out += chunk
            closed = True
        except TimeoutError:
            pass
        except OSError:  # reset: closed too
            closed = True
        return out, closed


def status_and_body(response: bytes) -> tuple[int, bytes]:
    """The status and body of an HTTP/1.1 response read to its end (a chunked body decoded)."""
    head, _, body = response.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" in head.lower():
        chunks = []
        while body:
            size, _, body = body.partition(b"\r\n")
            n = int(size.split(b";")[0], 16)
            chunks.append(body[:n])
            body = body[n + 2:]
        body = b"".join(chunks)
    return int(head.split(b" ", 2)[1]), body


def assert_error(r: httpx.Response, status: int, param: str | None, pattern: str) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["param"] == param, error
    assert re.search(pattern, error["message"]), error["message"]


def post(url: str, path: str, body: dict | bytes, **kw) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(url + path, content=content, headers=kw.pop("headers", JSON), timeout=30, **kw)


# --- slow bodies -----------------------------------------------------------------------------------------------

def test_eight_slow_bodies_hold_no_place_among_the_requests_in_flight(engine, tok, base):
    """Eight clients that send headers and one byte of a 100-byte body used to fill --max-concurrency 8: the
    request was counted before its body arrived. Now /health and a normal request are answered beside them."""
    app = create_app(engine, tok, "tiny", generation_config=base, max_concurrency=8, body_timeout=60)
    with running_server(app) as url:
        slow = []
        try:
            for _ in range(8):
                s = socket.create_connection(("127.0.0.1", port_of(url)), timeout=10)
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 100\r\n\r\n{")
                slow.append(s)
            assert httpx.get(url + "/health", timeout=10).json()["in_flight"] == 0
            r = post(url, "/v1/completions", {"prompt": "Hello", "max_tokens": 16, "seed": 1})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16, r.text
        finally:
            for s in slow:
                s.close()


def test_a_body_that_does_not_arrive_in_time_gets_408_and_the_connection_closes(server):
    response, closed = raw(server, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                   b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{", timeout=3)
    status, body = status_and_body(response)
    assert closed, "the connection stayed open after the 408"
    error = json.loads(body)["error"]
    assert status == 408 and error["code"] == "request_timeout", response
    assert re.search(r"did not arrive within 0\.25 s \(--body-timeout\)", error["message"])
    assert httpx.get(server + "/health").status_code == 200


def test_a_request_head_that_does_not_arrive_in_time_gets_408_and_the_connection_closes():
    """A real `dgemma serve --header-timeout 1`: a client that sends part of a request line and then nothing (or a
    byte a minute) used to hold its connection forever (uvicorn has no header timeout). Now, while it waits, others
    are served, and then the server answers 408 with OpenAI's error object and closes the connection; so it does
    for a connection that sends nothing, and for a later request's head on a kept-alive connection (sent after the
    first answer, or pipelined with the first request)."""
    env = {"PYTHONPATH": str(Path(__file__).resolve().parents[2]), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin",
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "dgemma", "serve", "--preset", "tiny", "--random-init", "--port",
                             "0", "--max-batch", "1", "--max-context", "64", "--header-timeout", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert "http://127.0.0.1:" in line, (line, proc.stderr.read() if proc.poll() is not None else "")
        url = line.split(" at ")[1].split()[0].rstrip("/")
        port = int(url.rsplit(":", 1)[1])

        def head_then_wait(answered: bytes, first: bytes) -> tuple[bytes, bool]:
            """Send the whole requests `answered` and read their answers, then `first` (part of a head), then read
            until the server closes the connection."""
            s = socket.create_connection(("127.0.0.1", port), timeout=60)  # 60 s: a guard, not a measure
            try:
                if answered:
                    s.sendall(answered)
                    got = b""
                    while b"\r\n\r\n" not in got:
                        got += s.recv(65536)
                    head, _, body = got.partition(b"\r\n\r\n")
                    length = int(re.search(rb"content-length: (\d+)", head.lower()).group(1))
                    while len(body) < length:
                        body += s.recv(65536)
                s.sendall(first)
                if first == b"GET /hea":  # the slow client is still waiting while another is served
                    assert httpx.get(url + "/health", timeout=30).status_code == 200
                got = b""
                while chunk := s.recv(65536):
                    got += chunk
                    if b"request_timeout" in got:
                        break
                return got, s.recv(1) == b""
            finally:
                s.close()

        health = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
        for answered, first in ((b"", b"GET /hea"), (b"", b""), (health, b"GET /heal"), (b"", health + b"GET /h")):
            response, closed = head_then_wait(answered, first)
            assert closed, f"{first!r}: the connection stayed open"
            last = response[response.rindex(b"HTTP/1.1 "):]
            status, body = status_and_body(last)
            error = json.loads(body)["error"]
            assert status == 408 and error["code"] == "request_timeout", response
            assert error["message"] == "the request line and headers did not arrive within 1 s (--header-timeout)"
        assert httpx.get(url + "/health", timeout=30).status_code == 200
    finally:
        proc.kill()
        proc.wait(30)


# --- caps on work ----------------------------------------------------------------------------------------------

def test_denoising_steps_and_total_work_are_capped(server):
    assert_error(post(server, "/v1/completions", {"prompt": "x", "max_tokens": 16, "max_denoising_steps": 10**9}),
                 400, "max_denoising_steps", r"at most 8 on this server \(--limit-denoising-steps\), got 1000000000")
    # 2 choices x 5 canvases of 16 x 8 steps = 80 > 64
    assert_error(post(server, "/v1/chat/completions", {"messages": USER, "max_completion_tokens": 80, "n": 2,
                                                       "max_denoising_steps": 8}),
                 400, "max_completion_tokens", r"may run 80 denoising steps \(2 choices x 5 canvases of 16 tokens x "
                                               r"max_denoising_steps=8\); at most 64 on this server "
                                               r"\(--max-request-steps\)")
    ok = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 32, "n": 2, "max_denoising_steps": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 64, ok.text


def test_corrector_passes_count_against_both_step_caps(server, capsys, tok_path):
    """A predictor-corrector request costs max_denoising_steps x (1 + corrector_steps) model passes a canvas: over
    --limit-denoising-steps that is a 400 naming corrector_steps (it used to be accepted whatever corrector_steps
    was), and over --max-request-steps too when the corrector passes are what takes it over; `serve` refuses such a
    default in one line."""
    pc = {"prompt": "x", "sampler": "predictor-corrector"}
    assert_error(post(server, "/v1/completions", {**pc, "max_tokens": 16, "max_denoising_steps": 2,
                                                  "corrector_steps": 10**9}),
                 400, "corrector_steps", r"max_denoising_steps=2 x \(1 \+ corrector_steps=1000000000\) make "
                                         r"2,000,000,002 model passes a canvas; at most 8 on this server "
                                         r"\(--limit-denoising-steps\)")
    # 2 choices x 5 canvases x 4 steps x (1 + 1 corrector pass) = 80 > 64; without the corrector passes 40
    assert_error(post(server, "/v1/completions", {**pc, "max_tokens": 80, "n": 2, "max_denoising_steps": 4,
                                                  "corrector_steps": 1}),
                 400, "corrector_steps", r"may run 80 denoising steps \(2 choices x 5 canvases of 16 tokens x "
                                         r"max_denoising_steps=4 x \(1 \+ corrector_steps=1\)\); at most 64")
    ok = post(server, "/v1/completions", {**pc, "max_tokens": 16, "max_denoising_steps": 4, "corrector_steps": 1})
    assert ok.status_code == 200, ok.text
    threads = torch.get_num_threads()
    try:
        assert cli.main(["serve", "--preset", "tiny", "--random-init", "--tokenizer", str(tok_path),
                         "--sampler", "predictor-corrector", "--max-denoising-steps", "8", "--corrector-steps", "2",
                         "--limit-denoising-steps", "10", "--max-context", "64", "--port", "0"]) == 2
    finally:
        torch.set_num_threads(threads)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.fullmatch(r"dgemma serve: error: .*corrector_steps: max_denoising_steps=8 x \(1 \+ "
                                          r"corrector_steps=2\) make 24 model passes a canvas; at most 10 on this "
                                          r"server.*", err[0]), err


def test_serve_refuses_a_default_over_its_cap_and_bad_limits(capsys, tok_path):
    threads = torch.get_num_threads()  # `serve` sets the process's torch threads once past its flag checks
    try:
        assert cli.main(["serve", "--preset", "tiny", "--random-init", "--tokenizer",
                         str(tok_path), "--max-denoising-steps", "20",
                         "--limit-denoising-steps", "10", "--max-context", "64", "--port", "0"]) == 2
    finally:
        torch.set_num_threads(threads)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.fullmatch(r"dgemma serve: error: .*max_denoising_steps: at most 10 on this server.*"
                                          r"got 20", err[0]), err
    for flag, value in (("--max-request-steps", "0"), ("--body-timeout", "0"), ("--body-timeout", "nan")):
        assert cli.main(["serve", "--preset", "tiny", "--random-init", flag, value]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"dgemma serve: error: {flag} must be"), err


# --- the event loop --------------------------------------------------------------------------------------------

class Gate:
    """A real pre-tokenizer step that holds the tokenizing thread on prompts containing GATE until released."""

    def __init__(self):
        self.entered, self.release = threading.Event(), threading.Event()

    def split(self, i, piece):
        if "GATE" in str(piece):
            self.entered.set()
            self.release.wait(30)
        return [piece]

    def pre_tokenize(self, pretok):
        pretok.split(self.split)


def test_tokenizing_a_prompt_does_not_stop_the_event_loop(engine, base):
    """While one prompt is being tokenized (held here as long as the test likes, as a 1 MB prompt holds a real
    tokenizer), /health still answers: tokenizing runs on a worker thread, not on the event loop."""
    gated = build_test_tokenizer(512)
    gate = Gate()
    gated.backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.PreTokenizer.custom(gate),
                                                           gated.backend.pre_tokenizer])
    with running_server(create_app(engine, gated, "tiny", generation_config=base)) as url:
        answers: list[httpx.Response] = []
        client = threading.Thread(target=lambda: answers.append(
            post(url, "/v1/completions", {"prompt": "GATE open", "max_tokens": 16})))
        client.start()
        try:
            assert gate.entered.wait(30), "the prompt was never tokenized"
            health = httpx.get(url + "/health", timeout=10)
            assert health.status_code == 200 and health.json()["in_flight"] == 1
        finally:
            gate.release.set()
            client.join(30)
        assert answers and answers[0].status_code == 200, answers


# --- auth and cross-site requests -------------------------------------------------------------------------------

@pytest.mark.parametrize("key", ["", " ", "sk key", "sk-\u00e9"])
def test_a_key_that_protects_nothing_is_refused_at_start(capsys, engine, tok, key):
    assert cli.main(["serve", "--preset", "tiny", "--random-init", "--api-key", key]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.fullmatch(r"dgemma serve: error: --api-key: must be a non-empty string of printable "
                                          r"ASCII without spaces, got .*", err[0]), err
    with pytest.raises(ValueError, match="--api-key: must be a non-empty"):
        create_app(engine, tok, "tiny", api_key=key)


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/json; charset=latin-1"])
def test_posts_that_are_not_json_get_415(server, content_type):
    headers = {} if content_type is None else {"Content-Type": content_type}
    r = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 16}, headers=headers)
    assert_error(r, 415, None, r"Content-Type: must be application/json \(UTF-8\), got ")
    assert r.json()["error"]["code"] == "unsupported_media_type"


def test_json_with_a_utf8_charset_is_accepted(server):
    r = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 16},
             headers={"Content-Type": "Application/JSON; charset=UTF-8"})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("host, answered", [("127.0.0.1", True), ("localhost:8000", True), ("127.5.6.7:1", True),
                                            ("[::1]:80", True), ("LOCALHOST.", True), ("evil.example", False),
                                            ("evil.example:8000", False), ("127.0.0.1.evil.example", False),
                                            ("[::2]", False), ("", False)])
def test_a_loopback_server_without_a_key_answers_only_loopback_host_names(server, host, answered):
    r = httpx.get(server + "/health", headers={"Host": host})
    if answered:
        assert r.status_code == 200, r.text
    else:
        assert_error(r, 403, None, r"Host header .* is not allowed: .* --allowed-hosts NAME")


def test_which_host_names_a_server_answers():
    assert allowed_hosts("127.0.0.1", None) == ("loopback",) == allowed_hosts("::1", None)
    assert allowed_hosts("localhost", None) == ("loopback",)
    assert allowed_hosts("127.0.0.1", "sk-key") is None  # the key protects it
    assert allowed_hosts("0.0.0.0", None) is None  # exposed deliberately
    assert allowed_hosts("127.0.0.1", None, ["My.Box."]) == ("loopback", "my.box")
    assert allowed_hosts("127.0.0.1", None, ["*"]) is None


def test_serve_command_checks_host_names_and_allowed_hosts_adds_them():
    env = {"PYTHONPATH": str(Path(__file__).resolve().parents[2]), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    proc = subprocess.Popen([sys.executable, "-m", "dgemma", "serve", "--preset", "tiny", "--random-init", "--port",
                             "0", "--max-batch", "1", "--max-context", "64", "--allowed-hosts", "my.box"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert "http://127.0.0.1:" in line, (line, proc.stderr.read() if proc.poll() is not None else "")
        url = line.split(" at ")[1].split()[0].rstrip("/")
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        assert httpx.get(url + "/health", headers={"Host": "my.box:80"}, timeout=10).status_code == 200
        assert_error(httpx.get(url + "/health", headers={"Host": "rebound.example"}, timeout=10), 403, None,
                     r"'rebound.example' is not allowed: this server answers only localhost, 127.x.x.x, \[::1\], "
                     r"my.box")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()


# --- JSON and templates that used to answer 500 ----------------------------------------------------------------

DEEP = b"[" * 20_000 + b"]" * 20_000  # past the JSON decoder's recursion limit, within the body cap


@pytest.mark.parametrize("path, body, param, pattern", [
    ("/v1/completions", b'{"prompt": ' + DEEP + b"}", None, r"nests deeper than 64 levels"),
    ("/v1/completions", b'{"prompt": "x", "stop": ' + b"[" * 70 + b"]" * 70 + b"}", "stop",
     r"at stop\[0\]\[0\].*: nests deeper than 64 levels"),
    ("/v1/completions", b'{"prompt": "x", "seed": ' + b"9" * 5000 + b"}", "seed",
     r"at seed: an integer of 5,000 digits; at most 64"),
    ("/v1/completions", b'{"prompt": "\\ud800"}', "prompt", r"at prompt: a lone surrogate \(U\+D800\)"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\udfffb"}]}', "messages",
     r"at messages\[0\]\.content: a lone surrogate \(U\+DFFF\)"),
    ("/v1/completions", b'{"prompt": "x", "\\ud800": 1}', None, r"a key with a lone surrogate"),
    ("/v1/completions", b'{"prompt": "x", "entropy_bound": NaN}', "entropy_bound",
     r"NaN is not a JSON number \(non-finite numbers are refused\)"),
    ("/v1/completions", b'{"prompt": "x", "t_max": 1e999}', "t_max", r"the number 1e999 overflows a float"),
    ("/v1/chat/completions", json.dumps({"messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[" * 5000 + "]" * 5000}}]},
        {"role": "user", "content": "ok"}]}).encode(), "messages",
     r"messages\[1\]\.tool_calls\[0\]\.function\.arguments: nests deeper than 64 levels"),
])
def test_hostile_json_gets_400_naming_the_field(server, path, body, param, pattern):
    assert_error(post(server, path, body), 400, param, pattern)


@pytest.mark.parametrize("source, pattern", [
    ("{% for i in range(10**30) %}{{ i }}{% endfor %}", r"OverflowError"),
    ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", r"RecursionError"),
    ("{{ messages[0].content | int // 0 }}", r"ZeroDivisionError"),
    ('{{ "\\ud800" }}{{ messages[0].content }}', r"UnicodeEncodeError"),
])
def test_a_template_that_fails_to_render_is_a_400_naming_it(engine, tok, base, source, pattern):
    template = ChatTemplate(source, origin="bad.jinja")
    with running_server(create_app(engine, tok, "tiny", generation_config=base, template=template)) as url:
        assert_error(post(url, "/v1/chat/completions", {"messages": USER}), 400, "messages",
                     rf"chat template \(bad\.jinja\) cannot render these messages: {pattern}")


@pytest.mark.parametrize("source, pattern", [
    ("{% for m in messages %}{{ m.content * 1000000 }}{% endfor %}",
     r"'\*' would make a value of ~100,000,000 characters"),
    ("{% for m in messages %}{{ m.content | center(m.content | length * 100000) }}{% endfor %}",
     r"a width or count of 10,000,000"),
    ("{% if messages | length > 1 %}{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
     "{% endfor %}{% endif %}{{ messages[0].content }}", r"rendering took longer than 2 s"),
], ids=["repeat", "center", "loops"])
def test_a_template_past_its_render_limits_is_a_400_and_the_server_goes_on(engine, tok, base, source, pattern):
    """Templates that render the plainest conversation (so they load) but not these messages: the render stops at
    its size or time limit with a 400 naming the template (it used to write 100 MB and tokenize it, or loop for
    hours), and the server answers the next request."""
    template = ChatTemplate(source, origin="big.jinja")
    messages = [{"role": "user", "content": "x" * 100}, {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "y"}]
    with running_server(create_app(engine, tok, "tiny", generation_config=base, template=template)) as url:
        assert_error(post(url, "/v1/chat/completions", {"messages": messages}), 400, "messages",
                     rf"chat template \(big\.jinja\) passed a render limit: {pattern}")
        assert httpx.get(url + "/health", timeout=30).status_code == 200
        assert post(url, "/v1/completions", {"prompt": "x", "max_tokens": 4}).status_code == 200


def test_a_t_max_that_overflows_float32_is_a_400_naming_it(server):
    assert_error(post(server, "/v1/completions", {"prompt": "x", "t_max": 1e308}), 400, "t_max",
                 r"t_max: must be a finite number within float32's range")


# --- fuzzing with malformed HTTP -------------------------------------------------------------------------------

FIELDS = ("prompt", "messages", "max_tokens", "n", "seed", "stream", "stop", "temperature", "stream_options",
          "max_denoising_steps", "t_max", "tools", "model", "bogus")
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4), max_leaves=12)
plausible = st.fixed_dictionaries({}, optional={k: json_values for k in FIELDS}) | st.fixed_dictionaries(
    {"prompt": st.text(min_size=1, max_size=20)}, optional={"max_tokens": st.integers(-1, 40), "n": st.integers(0, 3),
                                                            "stream": st.booleans(), "seed": st.integers(-1, 9)})
sizes = st.sampled_from([5000, 1000, 65, 64, 63, 1])  # nesting depths and digit counts around the limits
hostile = st.one_of(sizes.map(lambda k: b"[" * k + b"]" * k), sizes.map(lambda k: b"9" * k),
                    st.sampled_from([b'"\\ud800"', b'"a\\udfff"', b"NaN", b"-Infinity", b"1e999"]))
hostile_bodies = st.tuples(st.sampled_from([b'{"prompt": %s}', b'{"prompt": "x", "seed": %s}',
                                            b'{"prompt": "x", "t_max": %s}', b'{"messages": [{"role": "user", '
                                            b'"content": %s}]}', b'{"prompt": "x", "stop": [%s]}']),
                           hostile).map(lambda t: t[0] % t[1])
paths = st.sampled_from(["/v1/completions"] * 4 + ["/v1/chat/completions"] * 4 + [
    "/v1/models", "/v1/models/tiny", "/health", "/metrics", "/", "/v1/nowhere", "/%zz", "/v1/models/" + "a" * 3000])
methods = st.sampled_from(["POST"] * 6 + ["GET", "PUT", "DELETE", "OPTIONS", "HEAD", "PATCH", "G\x00T", "BREW"])
header_values = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=40)


@st.composite
def http_requests(draw) -> tuple[str, bytes]:
    """(kind, request bytes) of a malformed or odd HTTP request; each ends in Connection: close or is not a
    request, so that the server closes the connection after its answer."""
    kind = draw(st.sampled_from(["random", "request line", "headers", "huge header", "content-length",
                                 "truncated", "chunked", "json", "json", "hostile json", "hostile json"]))
    if kind == "random":
        return kind, draw(st.binary(max_size=200)) + b"\r\n\r\n"
    method, path = draw(methods), draw(paths)
    if kind.endswith("json"):  # a body for the routes that parse one
        method, path = "POST", draw(st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
    version = draw(st.sampled_from(["HTTP/1.1"] * 4 + ["HTTP/1.0", "HTTP/2.0", "HTTP/9", "http/1.1", ""]))
    if kind == "request line":
        line = draw(st.sampled_from([f"{method} {path} {version}", f"{method}  {path}", f"{path} {version}",
                                     f"{method} {path} {version} extra", draw(header_values)]))
        return kind, line.encode("latin-1") + b"\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    body = draw(hostile_bodies if kind == "hostile json" else st.builds(lambda v: json.dumps(v).encode(),
                                                                       json_values | plausible))
    hosts, types = ["127.0.0.1", "localhost:80", "evil.example", "[::1]", ""], ["application/json", "text/plain", ""]
    if kind == "json":
        hosts, types = ["127.0.0.1"] * 4 + hosts, ["application/json"] * 4 + types
    elif kind == "hostile json":
        hosts, types = ["127.0.0.1"], ["application/json"]
    headers = [("Host", draw(st.sampled_from(hosts))), ("Content-Type", draw(st.sampled_from(types))),
               ("Connection", "close")]
    if kind == "headers":
        headers += draw(st.lists(st.tuples(header_values, header_values), max_size=4))
    if kind == "huge header":
        headers.append(("X-Big", "a" * draw(st.integers(10_000, 100_000))))
    declared = len(body)
    if kind == "content-length":
        declared = draw(st.sampled_from([-1, 0, len(body) // 2, 10**30]))
        headers.append(("Content-Length", str(declared)))
        if draw(st.booleans()):
            headers.append(("Content-Length", "3"))
    elif kind == "truncated":
        headers.append(("Content-Length", str(len(body) + draw(st.integers(1, 100)))))
    elif kind == "chunked":
        headers.append(("Transfer-Encoding", "chunked"))
        body = draw(st.sampled_from([b"zz\r\n{}\r\n0\r\n\r\n", b"2\r\n{}\r\n", b"ffffffffffff\r\n{",
                                     b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body),
                                     b"1;ext\r\n{\r\n1\r\n}\r\n0\r\n\r\n"]))
    else:
        headers.append(("Content-Length", str(len(body))))
    head = f"{method} {path} {version}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers)
    return kind, head.encode("latin-1") + b"\r\n" + body


def check_answer(url: str, kind: str, request: bytes) -> str | None:
    """What is wrong with the server's answer to `request`, or None: an answer within 2 s (random bytes may be
    no request at all), no 5xx, every JSON 4xx OpenAI's error object, a non-JSON 4xx only uvicorn's own answer to
    what is not HTTP, and /health still answering."""
    response, _ = raw(url, request, timeout=2.0)
    problem = None if response or kind == "random" else "no answer within 2 s"
    if response:
        try:
            status, body = status_and_body(response)
        except (IndexError, ValueError):
            return f"not an HTTP response: {response[:80]!r}"
        head = response.split(b"\r\n\r\n", 1)[0].lower()
        if status >= 500:
            problem = f"{status}: {body[:200]!r}"
        elif request.startswith(b"HEAD "):  # an answer without a body
            pass
        elif status >= 400 and b"content-type: application/json" in head:
            try:
                error = json.loads(body)["error"]
                if set(error) != {"message", "type", "param", "code"}:
                    problem = f"{status}: not OpenAI's error object: {body[:200]!r}"
            except (ValueError, KeyError, TypeError):
                problem = f"{status}: not OpenAI's error object: {body[:200]!r}"
        elif status >= 400 and body not in (b"Invalid HTTP request received.", b"Unsupported upgrade request."):
            problem = f"{status}: neither JSON nor uvicorn's protocol error: {response[:200]!r}"
    if httpx.get(url + "/health", timeout=10).status_code != 200:
        problem = (problem or "") + "; /health stopped answering"
    return problem


@settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(case=http_requests())
def test_malformed_http_never_gets_a_5xx_and_the_server_goes_on(server, case):
    kind, request = case
    problem = check_answer(server, kind, request)
    assert problem is None, f"{kind}: {request[:300]!r} -> {problem}"


def test_ctrl_c_with_a_stream_open_ends_it_with_an_error_event_and_done():
    """Ctrl-C while a long stream runs: the stream ends at once with OpenAI's error object and [DONE] (no broken
    chunked read, no traceback), and the server exits 0 without waiting out a graceful timeout."""
    env = {"PYTHONPATH": str(Path(__file__).resolve().parents[2]), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin",
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "dgemma", "serve", "--preset", "tiny", "--random-init", "--port",
                             "0", "--max-batch", "1", "--max-context", "2048"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert "http://127.0.0.1:" in line, (line, proc.stderr.read() if proc.poll() is not None else "")
        url = line.split(" at ")[1].split()[0].rstrip("/")
        # the random model must not end the stream itself (an EOS drawn under the request's random seed) before the
        # Ctrl-C does: EOS (token 1 of the tiny preset) is never drawn at -100
        body = {"prompt": "The sea", "max_tokens": 1024, "max_denoising_steps": 64, "stream": True,
                "logit_bias": {"1": -100}}
        events = []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            for raw in r.iter_lines():
                if not raw.startswith("data: "):
                    continue
                events.append(raw[len("data: "):])
                if len(events) == 1:
                    stopped_at = time.monotonic()
                    proc.send_signal(signal.SIGINT)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "server_shutting_down" and error["type"] == "server_error"
        assert proc.wait(30) == 0 and time.monotonic() - stopped_at < 5
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
