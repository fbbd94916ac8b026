"""The prompts file ``vlkv calibrate`` reads: one public-API request per line (JSONL), no answers.

Each line is a JSON object with exactly one of
- ``"prompt"``: plain text, ``<image>`` marking each image (``GenerateRequest.text``);
- ``"question"``: one user turn after the images (``vlkv generate --chat``; rendered with the chat template);
- ``"messages"``: chat messages, ``{"role": "user" | "assistant" | "system", "content": str | [parts]}`` with
  parts ``{"type": "text", "text": ...}`` or ``{"type": "image"}`` (``GenerateRequest.chat``);
and optionally ``"images"``: a list of strings, each a file path (relative paths from the JSONL file's
folder), a data URL (``data:image/png;base64,...``) or bare base64 of a PNG/JPEG; ``"id"``: a name for
the line (ignored). Any other key (an ``"answer"``, say) is refused: calibration is label-free.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from pathlib import Path

from vlkv.v1 import generate_pb2

PROMPT_KEYS = ("prompt", "question", "messages")
ALLOWED_KEYS = (*PROMPT_KEYS, "images", "id")


def _image(value, where: str, folder: Path) -> bytes:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{where}: an image must be a non-empty string (a path or base64)")
    if value.startswith("data:"):
        head, _, data = value.partition(",")
        if not head.endswith(";base64"):
            raise ValueError(f"{where}: only base64 data URLs are accepted")
        value = data
    elif len(value) < 1024:
        path = Path(value) if Path(value).is_absolute() else folder / value
        try:
            return path.read_bytes()
        except OSError:
            pass  # not a readable file: base64?
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{where}: {value[:40]!r} is neither a file nor base64") from None


def _message(msg, where: str) -> generate_pb2.ChatMessage:
    if not isinstance(msg, dict) or set(msg) - {"role", "content"} or not isinstance(msg.get("role"), str):
        raise ValueError(f"{where}: a message is {{'role': ..., 'content': ...}}")
    out = generate_pb2.ChatMessage(role=msg["role"])
    content = msg.get("content", "")
    parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
    if not isinstance(parts, list):
        raise ValueError(f"{where}: content must be a string or a list of parts")
    for part in parts:
        if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
            out.content.append(generate_pb2.ContentPart(text=part["text"]))
        elif isinstance(part, dict) and part == {"type": "image"}:
            out.content.append(generate_pb2.ContentPart(image=generate_pb2.ImagePlaceholder()))
        else:
            raise ValueError(f"{where}: a part is {{'type': 'text', 'text': ...}} or {{'type': 'image'}}")
    return out


def request_from_json(line: dict, where: str, folder: Path) -> generate_pb2.GenerateRequest:
    """One line as the public API's ``GenerateRequest``; ValueError names the line and the problem."""
    if not isinstance(line, dict):
        raise ValueError(f"{where}: expected a JSON object")
    unknown = sorted(set(line) - set(ALLOWED_KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; a line holds {', '.join(ALLOWED_KEYS)}")
    kinds = [k for k in PROMPT_KEYS if k in line]
    if len(kinds) != 1:
        raise ValueError(f"{where}: give exactly one of {', '.join(PROMPT_KEYS)}")
    images = line.get("images", [])
    if not isinstance(images, list):
        raise ValueError(f"{where}: images must be a list")
    req = generate_pb2.GenerateRequest(
        request_id=str(line.get("id", where)), images=[_image(v, where, folder) for v in images]
    )
    kind, value = kinds[0], line[kinds[0]]
    if kind == "messages":
        if not isinstance(value, list) or not value:
            raise ValueError(f"{where}: messages must be a non-empty list")
        req.chat.messages.extend(_message(m, where) for m in value)
        return req
    if not isinstance(value, str) or not value:
        raise ValueError(f"{where}: {kind} must be a non-empty string")
    if kind == "prompt":
        req.text = value
    else:
        parts = [generate_pb2.ContentPart(image=generate_pb2.ImagePlaceholder()) for _ in images]
        parts.append(generate_pb2.ContentPart(text=value))
        req.chat.messages.append(generate_pb2.ChatMessage(role="user", content=parts))
    return req


def read_prompts(path: str | Path) -> tuple[list[generate_pb2.GenerateRequest], str]:
    """The requests in ``path`` and the sha256 of its bytes; ValueError for a bad or empty file."""
    path = Path(path)
    data = path.read_bytes()
    requests = []
    for i, raw in enumerate(data.decode("utf-8").splitlines(), 1):
        if not raw.strip():
            continue
        try:
            line = json.loads(raw)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{i}: not JSON ({err.msg})") from None
        requests.append(request_from_json(line, f"{path.name}:{i}", path.parent))
    if not requests:
        raise ValueError(f"{path}: no prompts")
    return requests, hashlib.sha256(data).hexdigest()


def write_prompts(path: str | Path, processor, examples, task) -> Path:
    """A prompts file from a task's examples (``lab/vlkv_lab/task``, ``lab/vlkv_lab/zoo``): each one's rendered prompt
    (``task.prompt_text``) and its images as base64 PNG, no answer."""
    import io

    lines = []
    for ex in examples:
        blobs = []
        for image in ex.images:
            buf = io.BytesIO()
            image.save(buf, format="PNG")
            blobs.append(base64.b64encode(buf.getvalue()).decode())
        lines.append(json.dumps({"prompt": task.prompt_text(processor, ex), "images": blobs}))
    Path(path).write_text("\n".join(lines) + "\n")
    return Path(path)
