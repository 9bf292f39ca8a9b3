"""``rollout=hf``: transformers ``generate`` in the trainer's process, sharing the policy's weights."""

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from rlexp.models import mm_token_type_ids, never_generated_ids
from rlexp.rollout.engine import GenerationOutput, GenerationRequest, SamplingParams, VisionInputs, stop_token_ids


class _LogprobRecorder(LogitsProcessor):
    """Records each sampled token's log-probability without keeping every step's full distribution.

    At step s it sees the token chosen at step s-1 (the last column of ``input_ids``) and gathers its
    log-probability from the distribution kept from step s-1; only one step's distribution is held.
    It also masks the never-generated ids, so that the distribution it records is the one sampled
    from. Custom processors run before temperature/top-p (transformers appends the warpers after
    them), so the temperature is applied here.
    """

    def __init__(self, temperature: float, suppressed_ids: list[int]):
        self.temperature = temperature if temperature > 0 else 1.0
        self.suppressed_ids = suppressed_ids
        self.previous: torch.Tensor | None = None
        self.logprobs: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.gather(input_ids[:, -1])
        if self.suppressed_ids:
            scores = scores.index_fill(-1, torch.tensor(self.suppressed_ids, device=scores.device), float("-inf"))
        self.previous = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def gather(self, tokens: torch.Tensor) -> None:
        if self.previous is not None:
            self.logprobs.append(self.previous.gather(1, tokens[:, None]).squeeze(1))
            self.previous = None


class HFEngine:
    """Batched generation over left-padded prompts; the model object is the trainer's own.

    Generation settings are built here from ``SamplingParams`` alone: nothing in a checkpoint's
    ``generation_config.json`` (top_k, repetition_penalty, …) is inherited, since the trainer would not
    score with it.
    """

    def __init__(self, model, processor, static_cache: bool = False):
        self.model = model
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.static_cache = static_cache
        self.pad_id = self.tokenizer.pad_token_id
        self.eos_ids = stop_token_ids(model, self.tokenizer)
        self.suppressed_ids = never_generated_ids(self.tokenizer)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def generate(self, requests: list[GenerationRequest], params: SamplingParams) -> list[GenerationOutput]:
        if not requests:
            return []
        length = max(len(r.prompt_token_ids) for r in requests)
        input_ids = torch.full((len(requests), length), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for row, request in enumerate(requests):
            ids = request.prompt_token_ids
            input_ids[row, length - len(ids):] = torch.tensor(ids)
            attention_mask[row, length - len(ids):] = 1
        inputs = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "mm_token_type_ids": mm_token_type_ids(input_ids, self.model.config),
        }
        inputs = {k: v.to(self.device) for k, v in inputs.items()}
        vision = VisionInputs.concat([self._vision(r) for r in requests if r.images or r.vision is not None])
        if vision is not None:
            inputs["pixel_values"], inputs["image_grid_thw"] = vision.tensors(self.device)
        recorder = _LogprobRecorder(params.temperature, self.suppressed_ids)
        was_training = self.model.training
        self.model.eval()
        # transformers fills every unset generation setting from the checkpoint's generation_config.json;
        # an empty one in its place leaves only what generation_config(params) sets
        hf_model = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        checkpoint_defaults, hf_model.generation_config = hf_model.generation_config, GenerationConfig()
        try:
            sequences = self.model.generate(
                **inputs,
                generation_config=self.generation_config(params),
                tokenizer=self.tokenizer if params.stop else None,
                logits_processor=LogitsProcessorList([recorder]),
            )
        finally:
            hf_model.generation_config = checkpoint_defaults
            self.model.train(was_training)
        new_tokens = sequences[:, length:].cpu()
        recorder.gather(sequences[:, -1])
        logprobs = torch.stack(recorder.logprobs, dim=1).cpu() if recorder.logprobs else None
        return [self._output(new_tokens[row], logprobs[row], params) for row in range(len(requests))]

    def generation_config(self, params: SamplingParams) -> GenerationConfig:
        """Every setting explicit; greedy when the temperature is 0."""
        sampling = {}
        if params.temperature > 0:
            sampling = {"do_sample": True, "temperature": params.temperature, "top_p": params.top_p, "top_k": 0}
        return GenerationConfig(
            **sampling,
            repetition_penalty=1.0,
            max_new_tokens=params.max_new_tokens,
            stop_strings=params.stop or None,
            eos_token_id=self.eos_ids,
            pad_token_id=self.pad_id,
            cache_implementation="static" if self.static_cache else None,
        )

    def _vision(self, request: GenerationRequest) -> VisionInputs:
        if request.vision is not None:
            return request.vision
        processed = self.processor.image_processor(images=request.images, return_tensors="pt")
        return VisionInputs(processed["pixel_values"], processed["image_grid_thw"])

    def _output(self, tokens: torch.Tensor, logprobs: torch.Tensor, params: SamplingParams) -> GenerationOutput:
        """Cut one row at its first EOS (kept) or stop string, dropping the padding after it."""
        ids = tokens.tolist()
        end, finish = len(ids), "length"
        for i, token in enumerate(ids):
            if token in self.eos_ids:
                end, finish = i + 1, "stop"
                break
        if params.stop and any(s in self.tokenizer.decode(ids[:end]) for s in params.stop):
            for i in range(end):
                if any(s in self.tokenizer.decode(ids[: i + 1]) for s in params.stop):
                    end, finish = i + 1, "stop"
                    break
        ids = ids[:end]
        return GenerationOutput(
            token_ids=ids,
            logprobs=logprobs[:end].tolist(),
            text=self.tokenizer.decode(ids, skip_special_tokens=True),
            finish_reason=finish,
        )

    def load_weights(self, adapter_path=None) -> None:
        """Nothing to copy: the engine generates with the trainer's live parameters."""

    def sleep(self) -> None:
        pass

    def wake_up(self) -> None:
        pass

