"""``rollout=vllm``: vLLM's offline ``LLM`` on the trainer's GPU, serving the policy's LoRA adapter from files.

Written against vLLM 0.22 (``pip install 'rlexp[vllm]'``); vLLM is imported only when this engine is built,
so an install without it never loads it. What the engine guarantees, and how:

- **Token ids in and out.** Each request goes in as a ``TokensPrompt`` with its frames as
  ``multi_modal_data``. vLLM expands every ``<|image_pad|>`` it finds into the image's run itself (its
  Qwen3-VL processor replaces one pad per image by ``grid_h·grid_w / merge²`` pads), so the trainer's
  expanded runs are collapsed to one pad before they go in; the prompt vLLM reports back is compared with
  the trainer's ids on every request, and any difference stops the run naming the first position.
- **The trainer's distribution.** ``logprobs=0`` with ``logprobs_mode="processed_logprobs"`` returns each
  sampled token's log-prob after the logit bias (the never-generated ids at -inf, as the trainer masks
  them) and the temperature: the contract's log-softmax(logits / T). vLLM applies top-p before it
  records them, so with ``top_p < 1`` the gap to the trainer grows (``rollout/logprob_gap`` shows it).
  Nothing from the checkpoint's ``generation_config.json`` is inherited (``generation_config="vllm"``); it
  stops on the same ids as the ``hf`` engine.
- **Weight sync.** The base weights are frozen (LoRA), so only the adapter moves: ``load_weights`` writes it
  with peft (``<run>/global_step_N/policy`` from the training loop; a scratch dir of its own otherwise),
  serves it as a ``LoRARequest`` with a new int id, and removes the previous adapter from the engine and
  from disk.
- **Colocation.** ``sleep``/``wake_up`` around the trainer's update, at ``sleep_level`` 0 (never sleep),
  1 (weights to host memory, KV cache dropped) or ``auto``: the first update runs with level 1 while the
  trainer's extra memory is measured; from then on level 0 if that fits beside the awake engine with
  2 GiB to spare, else level 1.
"""

import importlib.util
import logging
import shutil
import tempfile
from pathlib import Path

import torch
from peft import PeftModel
from PIL import Image

from rlexp.config import ENGINE_DTYPES, SLEEP_LEVELS
from rlexp.models import never_generated_ids
from rlexp.rollout.engine import GenerationOutput, GenerationRequest, SamplingParams, stop_token_ids

log = logging.getLogger(__name__)

#: the LoRA ranks vLLM 0.22 can reserve (``max_lora_rank``); an adapter's rank is served by the next one up.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
#: with ``sleep_level=auto``: memory left free beside the awake engine and the trainer's peak.
AUTO_SLEEP_MARGIN_BYTES = 2 * 2**30


def vllm_missing() -> str | None:
    """Why vLLM cannot run here (one line), or None."""
    if importlib.util.find_spec("vllm") is None:
        return "rollout=vllm but vLLM is not installed here: pip install 'rlexp[vllm]' on a machine with a CUDA GPU"
    if not torch.cuda.is_available():
        return "rollout=vllm needs a CUDA GPU and none is visible here; use rollout=hf"
    return None


def engine_dtype(requested: str, policy_dtype: torch.dtype, lora: bool) -> str:
    """The dtype vLLM serves in: ``auto`` is the policy's, except that a float32 policy with a LoRA adapter is
    served in bfloat16, since vLLM 0.22's LoRA kernels (punica, Triton) take 16-bit weights only."""
    if requested not in ENGINE_DTYPES:
        raise ValueError(f"rollout.engine.dtype={requested}; valid: {', '.join(ENGINE_DTYPES)}")
    policy = str(policy_dtype).removeprefix("torch.")
    if requested == "float32" and lora:
        raise ValueError("rollout.engine.dtype=float32 with a LoRA adapter: vLLM's LoRA kernels take bfloat16 or float16 only")
    if requested != "auto":
        return requested
    if policy == "float32" and lora:
        log.info("vLLM serves the float32 policy in bfloat16: its LoRA kernels take 16-bit weights only")
        return "bfloat16"
    return policy


def collapse_image_runs(token_ids: list[int], image_token_id: int) -> list[int]:
    """Each run of image pads as one pad: the prompt form vLLM expands itself (see the module docstring)."""
    out: list[int] = []
    for token in token_ids:
        if not (token == image_token_id and out and out[-1] == image_token_id):
            out.append(token)
    return out


class VLLMEngine:
    """vLLM in its own engine process on the same GPU; ``model`` is the trainer's policy (a peft model with
    a LoRA adapter, or a plain model to evaluate without one), read for its path, dtype and adapter."""

    def __init__(
        self,
        model,
        processor,
        gpu_memory_utilization: float = 0.45,
        sleep_level: str = "auto",
        max_model_len: int | None = None,
        max_images_per_prompt: int = 1,
        seed: int = 0,
        enforce_eager: bool = False,
        dtype: str = "auto",
    ):
        reason = vllm_missing()
        if reason:
            raise RuntimeError(reason)
        if str(sleep_level) not in SLEEP_LEVELS:
            raise ValueError(f"sleep_level={sleep_level}; valid: {', '.join(SLEEP_LEVELS)}")
        from vllm import LLM

        self.model, self.processor = model, processor
        self.tokenizer = processor.tokenizer
        lora_model = isinstance(model, PeftModel)
        base = model.get_base_model() if lora_model else model
        self.image_token_id = base.config.image_token_id
        self.eos_ids = stop_token_ids(base, self.tokenizer)
        self.mask = {token: float("-inf") for token in never_generated_ids(self.tokenizer)}
        self.sleep_level = str(sleep_level)
        self.lora_rank = model.peft_config["default"].r if lora_model else None
        lora = {}
        if self.lora_rank is not None:
            max_rank = next((r for r in VLLM_LORA_RANKS if r >= self.lora_rank), None)
            if max_rank is None:
                raise ValueError(f"LoRA rank {self.lora_rank} is above vLLM's largest, {VLLM_LORA_RANKS[-1]}")
            lora = {"enable_lora": True, "max_lora_rank": max_rank, "max_loras": 1}
        self.llm = LLM(
            model=base.config.name_or_path,
            dtype=engine_dtype(str(dtype), base.dtype, self.lora_rank is not None),
            seed=seed,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            enable_prefix_caching=True,
            enable_sleep_mode=self.sleep_level != "0",
            limit_mm_per_prompt={"image": max_images_per_prompt, "video": 0},
            logprobs_mode="processed_logprobs",
            generation_config="vllm",
            enforce_eager=enforce_eager,
            **lora,
        )
        self._scratch = tempfile.TemporaryDirectory(prefix="rlexp-vllm-adapters-")
        self._next_id = 1
        self._lora = None
        #: the level the current sleep used (None: awake), and what ``auto`` measures on its first sleep.
        self._asleep: int | None = None
        self._free_awake = self._reserved_at_sleep = 0
        if self.lora_rank is not None:
            self.load_weights()

    # -- generation ---------------------------------------------------------------------------------

    def generate(self, requests: list[GenerationRequest], params: SamplingParams) -> list[GenerationOutput]:
        if not requests:
            return []
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm import TokensPrompt

        prompts = []
        for request in requests:
            prompt = TokensPrompt(prompt_token_ids=collapse_image_runs(request.prompt_token_ids, self.image_token_id))
            if request.images:
                prompt["multi_modal_data"] = {"image": [Image.fromarray(frame) for frame in request.images]}
            prompts.append(prompt)
        sampling = VLLMSamplingParams(
            temperature=params.temperature,
            top_p=params.top_p if params.temperature > 0 else 1.0,
            top_k=0,
            max_tokens=params.max_new_tokens,
            stop=params.stop or None,
            include_stop_str_in_output=True,
            stop_token_ids=self.eos_ids,
            logit_bias=self.mask,
            logprobs=0,
            # the reply's text is decoded here, with the trainer's tokenizer; vLLM's is needed for stop strings only
            detokenize=bool(params.stop),
        )
        results = self.llm.generate(prompts, sampling, use_tqdm=False, lora_request=self._lora)
        outputs = []
        for request, result in zip(requests, results):
            check_prompt(request.prompt_token_ids, list(result.prompt_token_ids))
            completion = result.outputs[0]
            ids = list(completion.token_ids)
            outputs.append(GenerationOutput(
                token_ids=ids,
                logprobs=[step[token].logprob for step, token in zip(completion.logprobs, ids)],
                text=self.tokenizer.decode(ids, skip_special_tokens=True),
                finish_reason="stop" if completion.finish_reason == "stop" else "length",
            ))
        return outputs

    # -- weight sync --------------------------------------------------------------------------------

    def load_weights(self, adapter_path: str | Path | None = None) -> None:
        """Write the policy's adapter to ``adapter_path`` (or a scratch dir) and serve it under a new id;
        the previous adapter leaves the engine and the disk. A model without an adapter has nothing to sync."""
        if self.lora_rank is None:
            return
        path = Path(adapter_path) if adapter_path is not None else Path(self._scratch.name) / f"v{self._next_id}"
        self.model.save_pretrained(str(path))
        previous = self._lora
        self._serve(path)
        if previous is not None and Path(previous.lora_path) != path:
            old = Path(previous.lora_path)
            shutil.rmtree(old, ignore_errors=True)
            if old.parent != Path(self._scratch.name):
                _remove_if_empty(old.parent)  # <run>/global_step_N, once its policy/ is gone

    def _serve(self, path: Path) -> None:
        from vllm.lora.request import LoRARequest

        request = LoRARequest(f"policy-{self._next_id}", self._next_id, str(path))
        self._next_id += 1
        engine = self.llm.llm_engine
        if self._lora is not None:
            engine.remove_lora(self._lora.lora_int_id)
        if not engine.add_lora(request):
            raise RuntimeError(f"vLLM did not load the LoRA adapter at {path}")
        self._lora = request

    def close(self) -> None:
        """Stop vLLM's engine process and remove the scratch adapters (its GPU memory is free after this)."""
        self.llm.llm_engine.engine_core.shutdown()
        self._scratch.cleanup()

    # -- colocation ---------------------------------------------------------------------------------

    def sleep(self) -> None:
        level = 1 if self.sleep_level == "auto" else int(self.sleep_level)
        if level == 0:
            return
        if self.sleep_level == "auto":
            self._free_awake = torch.cuda.mem_get_info()[0]
            self._reserved_at_sleep = torch.cuda.memory_reserved()
            torch.cuda.reset_peak_memory_stats()
        self.llm.sleep(level=level)
        self._asleep = level

    def wake_up(self) -> None:
        if self._asleep is None:
            return
        self.llm.wake_up()
        self._asleep = None
        if self.sleep_level == "auto":
            self._decide_sleep_level()

    def _decide_sleep_level(self) -> None:
        """``auto``, after the first update: level 0 when the trainer's extra memory fits beside the engine."""
        extra = torch.cuda.max_memory_reserved() - self._reserved_at_sleep
        fits = extra + AUTO_SLEEP_MARGIN_BYTES <= self._free_awake
        self.sleep_level = "0" if fits else "1"
        log.info(
            "rollout.engine.sleep_level=auto: the update needed %.1f GiB more, %.1f GiB were free beside the awake "
            "engine: sleep level %s from now on", extra / 2**30, self._free_awake / 2**30, self.sleep_level,
        )


def check_prompt(trainer_ids: list[int], engine_ids: list[int]) -> None:
    """The prompt vLLM consumed must be the trainer's, token for token (images expanded alike)."""
    if trainer_ids == engine_ids:
        return
    at = next((i for i, (a, b) in enumerate(zip(trainer_ids, engine_ids)) if a != b), min(len(trainer_ids), len(engine_ids)))
    raise RuntimeError(
        f"vLLM consumed a prompt other than the trainer's: {len(engine_ids)} tokens against {len(trainer_ids)}, first "
        f"difference at position {at} (trainer {trainer_ids[at:at + 3]}, vLLM {engine_ids[at:at + 3]})"
    )


def _remove_if_empty(folder: Path) -> None:
    try:
        folder.rmdir()
    except OSError:
        pass
