"""One zoo member: what the evaluation, the tests and the trainer need to know about it.

A member module ``vlkv_lab.zoo.<name>`` defines ``MEMBER = Member(...)`` (its task and checkpoint) and, when
it is trained here, ``RECIPE = Recipe(MEMBER, ...)`` with its declared stages (``lab/vlkv_lab/zoo/trainer.py``), run
by ``trainer.main(RECIPE)`` under ``__main__`` (its training command). Every member is scored by the one ``is_correct`` (``synthetic_task.is_correct`` over the member's
``scored`` words) and prompted by the one ``prompt_text`` (the checkpoint's chat template).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from vlkv.deploy import synthetic_task
from vlkv.deploy.synthetic_task import Example


@dataclass(frozen=True)
class Member:
    """A zoo member.

    - ``name``: its registry name (``lab/vlkv_lab/zoo/__init__.py`` ``MEMBERS``) and module name;
    - ``model_dir``: the shipped Hugging Face checkpoint (``lab/vlkv_lab/zoo/models/<name>/``), served through
      ``load_model`` / ``load_processor`` like any user's;
    - ``max_new_tokens``: enough for the longest answer plus eos;
    - ``geometry``: one line for the zoo table (vision tokens per image, layers, what the member stresses);
    - ``make_examples(n, seed=0, split="heldout") -> list[Example]``: deterministic; ``split`` is ``"train"``
      or ``"heldout"`` (disjoint seed spaces). The question is the text after the image(s) of a one-turn chat,
      exactly what ``vlkv.deploy.client.build_request(images=..., question=...)`` sends through the public
      API; anything before the images (an instruction) comes from the checkpoint's own chat template;
    - ``scored``: the words ``is_correct`` compares, in order, between the generated text and the answer;
    - ``eviction_trained``: fine-tuned to tolerate dropped KV (``lab/vlkv_lab/task/eviction.py``), as no user's
      checkpoint is: zoo tables mark it;
    - ``assemble``: for members whose checkpoint is not shipped whole (the real-decoder members: SmolLM2 from
      its GGUF plus the trained parts, ``smol_training.assemble``), builds ``model_dir`` on first use and
      returns it; ``load_member`` calls it.
    """

    name: str
    model_dir: Path
    max_new_tokens: int
    geometry: str
    make_examples: Callable[..., list[Example]]
    scored: frozenset[str] = synthetic_task.CONTENT_WORDS
    eviction_trained: bool = False
    assemble: Callable[[], Path] | None = None

    @classmethod
    def shipped(cls, name: str, max_new_tokens: int, geometry: str, make_examples, **facts) -> Member:
        """A member whose checkpoint ships in ``lab/vlkv_lab/zoo/models/<name>/``."""
        return cls(
            name,
            Path(__file__).resolve().parent / "models" / name,
            max_new_tokens,
            geometry,
            make_examples,
            **facts,
        )

    def checkpoint(self) -> Path:
        """The directory to load: ``model_dir``, assembled first where the member is built on first use
        (``assemble``); every caller that loads a member goes through here, so a fresh machine needs no
        earlier step."""
        return self.assemble() if self.assemble else self.model_dir

    def is_correct(self, generated_text: str, example: Example) -> bool:
        """True iff the ``scored`` words of the generated text (up to the first eos) are the answer's."""
        return synthetic_task.is_correct(generated_text, example, self.scored)

    def prompt_text(self, processor, example: Example) -> str:
        """The rendered prompt: the checkpoint's chat template over the example's one user turn."""
        return synthetic_task.prompt_text(processor, example)
