"""The `fastllm` command line. Each command parses its arguments here and hands the work to the
module that owns it; heavy imports happen inside the command, so `fastllm --help` stays instant.

Exit codes, all set in `main`: 0 the command finished; 1 the machine could not do it (a file
it could not write, memory it does not have, a device error), one line; 2 the input is wrong
(config, option, file), one line naming it; 130 and 143 `train` stopped by SIGINT or SIGTERM
after writing its checkpoint (the shell's codes for those signals: a script's `train && …`
stops there); anything else is a bug and keeps its traceback."""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from fastllm.config import ConfigError, MachineError
from fastllm.engine.schedule.simulator import EFFECTIVE_TFLOPS, LINK_GBPS

EXIT_FINISHED, EXIT_MACHINE, EXIT_INPUT = 0, 1, 2
"""The codes `main` returns besides 128 + a signal's number."""

MODEL_FAMILIES = ("gpt",)
"""Model families a config can describe; `gpt` (decoder-only transformers) is the default."""


def _config_command(
    commands: argparse._SubParsersAction,
    name: str,
    handler: Callable[[argparse.Namespace], int | None],
    **kwargs: str,
) -> argparse.ArgumentParser:
    """A command driven by a config: `-c FILE` (repeatable), then [FAMILY] KEY=VALUE overrides."""
    parser = commands.add_parser(name, **kwargs)
    parser.set_defaults(handler=handler)
    parser.add_argument(
        "-c",
        "--config",
        action="append",
        default=[],
        metavar="FILE",
        help="YAML config file; several are merged in order, later ones win",
    )
    parser.add_argument(
        "arguments",
        nargs="*",
        metavar="[FAMILY] KEY=VALUE",
        help=f"optional model family ({', '.join(MODEL_FAMILIES)}; default gpt), then overrides "
        "such as training.train_iters=10 or data.path[0]=/data/x (values are YAML)",
    )
    return parser


def _split_family(arguments: Sequence[str]) -> tuple[str, list[str]]:
    """The model family (first positional, optional) and the overrides after it."""
    family, overrides = "gpt", list(arguments)
    if overrides and "=" not in overrides[0]:
        family = overrides.pop(0)
        if family not in MODEL_FAMILIES:
            raise ConfigError(
                family, f"unknown model family; expected one of {', '.join(MODEL_FAMILIES)}"
            )
    for argument in overrides:
        if "=" not in argument:
            raise ConfigError(argument, "an override must have the form key=value")
    return family, overrides


def _load_trainer_config(args: argparse.Namespace):
    from fastllm.config import TrainerConfig, load_config

    _, overrides = _split_family(args.arguments)
    return load_config(TrainerConfig, args.config, overrides)


def _config_show(args: argparse.Namespace) -> None:
    from fastllm.config import dump_yaml

    sys.stdout.write(dump_yaml(_load_trainer_config(args)))


def _config_validate(args: argparse.Namespace) -> None:
    from fastllm.config.training import check_cadences

    config = _load_trainer_config(args)
    check_cadences(config.training)  # what `fastllm train` refuses of the config alone
    layout = None
    if args.world_size is not None:
        from fastllm.config.layout import resolve

        layout = resolve(config, args.world_size)
    base_model = config.model.base_model
    transformer = base_model.transformer
    source = ", ".join(args.config) or "defaults"
    total, active = base_model.num_parameters(), base_model.num_parameters(active=True)
    active_part = f" ({_count(active)} active per token)" if active < total else ""
    print(
        f"{source}: valid; {_count(total)} parameters{active_part}, "
        f"{transformer.num_layers} layers, hidden {transformer.hidden_size}, "
        f"vocabulary {base_model.vocab_size}"
    )
    if layout is not None:
        import msgspec
        import yaml

        sizes = {"layout": msgspec.to_builtins(layout)}
        sys.stdout.write(yaml.safe_dump(sizes, sort_keys=False, default_flow_style=None))


def _count(number: int) -> str:
    """A count to three significant digits in the largest unit it reaches: 1.31M, 8.03B."""
    for unit, size in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if number >= size * 0.9995:  # what rounds up to 1000 of a unit is 1 of the next
            return f"{number / size:.3g}{unit}"
    return str(number)


def _prepare(args: argparse.Namespace) -> None:
    import time

    from fastllm.config import load_config
    from fastllm.config.prepare import PrepareConfig
    from fastllm.data.prepare import prepare, summary

    _, overrides = _split_family(args.arguments)
    if args.strict:
        overrides.append("strict=true")
    config = load_config(PrepareConfig, args.config, overrides)
    start = time.perf_counter()
    report = prepare(config, overwrite=args.overwrite)
    print(summary(report, config.output.path, time.perf_counter() - start))


def _tokenizer_train(args: argparse.Namespace) -> None:
    from fastllm.config import load_config
    from fastllm.config.prepare import TokenizerTrainingConfig
    from fastllm.data.tokenizer_training import train_tokenizer

    _, overrides = _split_family(args.arguments)
    config = load_config(TokenizerTrainingConfig, args.config, overrides)
    output, bad = train_tokenizer(config)
    skipped = f"; {bad} bad record(s) skipped" if bad else ""
    print(f"{output}/tokenizer.json: byte-level BPE, {config.vocab_size} tokens{skipped}")


def _train(args: argparse.Namespace) -> int | None:
    from fastllm.config import TrainerConfig, build, load_raw
    from fastllm.training.setup import check_inputs, with_pretrained_architecture

    _, overrides = _split_family(args.arguments)
    config = build(TrainerConfig, with_pretrained_architecture(load_raw(args.config, overrides)))
    check_inputs(config)
    import torch
    import torch.distributed as dist

    from fastllm.training import Trainer
    from fastllm.training.out_of_memory import out_of_memory

    trainer = None
    try:
        trainer = Trainer(config)
        stopped = trainer.fit()
    except torch.OutOfMemoryError as error:
        raise out_of_memory(config, error, trainer and trainer.engine) from None
    if stopped is not None:
        # The code stands: torchrun signals the ranks still running when one exits, which
        # would otherwise kill them in the teardown below.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
    if dist.is_initialized():
        # No rank tears down the group (rank 0 hosts its store) while another still uses it.
        dist.barrier()
        dist.destroy_process_group()
    return None if stopped is None else stopped.exit_code


def _convert(args: argparse.Namespace) -> None:
    from fastllm.checkpoint.convert import convert
    from fastllm.config import load_config
    from fastllm.config.convert import ConvertConfig

    _, overrides = _split_family(args.arguments)
    config = load_config(ConvertConfig, args.config, overrides)
    output = convert(config)
    print(f"{config.input.path} ({config.input.format}) → {output} ({config.output.format})")


def _generate(args: argparse.Namespace) -> None:
    from fastllm.generation import generate_text

    print(
        generate_text(
            args.path,
            args.prompt,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            device=args.device,
            chat=args.chat,
            system=args.system,
            adapter=args.adapter,
        )
    )


def _evaluate(args: argparse.Namespace) -> None:
    from fastllm.config import load_raw
    from fastllm.config.evaluate import evaluate_config
    from fastllm.evaluate import evaluate

    _, overrides = _split_family(args.arguments)
    evaluate(evaluate_config(load_raw(args.config, overrides)))
    import torch.distributed as dist

    if dist.is_initialized():  # no rank tears down the group while another still uses it
        dist.barrier()
        dist.destroy_process_group()


def _schedule(args: argparse.Namespace) -> None:
    from fastllm.engine.schedule.simulator import report

    config = _load_trainer_config(args)
    if args.png is not None and not args.png.parent.is_dir():
        raise ConfigError("--png", f"{args.png.parent} is not a directory")
    rates = {"tflops": args.tflops, "pipeline_gbps": args.pipeline_gbps}
    print(report(config, args.world_size, args.png, data_gbps=args.data_gbps, **rates))


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _rate(text: str) -> float:
    """A compute or bandwidth figure for the cost model: positive, and at most a million
    (thousands of times an H200's; more rounds the predicted times to 0)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value <= 1e6:
        raise argparse.ArgumentTypeError(f"must be a number > 0 and ≤ 1e6, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number ≥ 0, got {text}")
    return value


def _native_version() -> str:
    try:
        from fastllm import _native
    except ImportError:
        return "not built"
    return _native.version()


def build_parser() -> argparse.ArgumentParser:
    from fastllm import __version__

    parser = argparse.ArgumentParser(
        prog="fastllm",
        description="Train large language models as fast as the hardware allows.",
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"fastllm {__version__} (native extension {_native_version()})",
        help="show the versions of fastllm and of its Rust extension",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    config = commands.add_parser("config", help="show or validate a training config")
    config_commands = config.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    _config_command(
        config_commands,
        "show",
        _config_show,
        help="print the resolved config with every default, as YAML",
    )
    validate = _config_command(
        config_commands,
        "validate",
        _config_validate,
        help="check a config and summarize the model (and its layout on --world-size ranks)",
    )
    validate.add_argument(
        "--world-size",
        type=_positive_int,
        default=None,
        help="also check the config on this many ranks and print every size the run uses",
    )

    prepare = _config_command(
        commands,
        "prepare",
        _prepare,
        help="tokenize text into a training dataset",
        description="Example: fastllm prepare input.path=data.jsonl tokenizer.path=tokenizer.json "
        "output.path=datasets/web",
    )
    prepare.add_argument("--overwrite", action="store_true", help="replace an existing output")
    prepare.add_argument("--strict", action="store_true", help="fail on the first bad record")

    tokenizer = commands.add_parser("tokenizer", help="tokenizer tools")
    tokenizer_commands = tokenizer.add_subparsers(
        dest="tokenizer_command", metavar="ACTION", required=True
    )
    _config_command(
        tokenizer_commands,
        "train",
        _tokenizer_train,
        help="train a byte-level BPE tokenizer on the inputs prepare reads",
        description="Example: fastllm tokenizer train input.path=src/ output=tokenizer vocab_size=8192",
    )

    _config_command(
        commands,
        "train",
        _train,
        help="train a model (alone or under torchrun)",
        description="Train from a config; starting again on the same run.experiment_dir resumes "
        "from its newest complete checkpoint.",
    )

    _config_command(
        commands,
        "convert",
        _convert,
        help="convert a checkpoint between fastllm and Hugging Face formats",
        description="Example: fastllm convert gpt input.format=llama input.path=HF_DIR "
        "output.format=fastllm output.path=OUT (output.type is a synonym of output.format)",
    )

    _config_command(
        commands,
        "evaluate",
        _evaluate,
        help="run lm-eval-harness tasks on a model (alone or under torchrun)",
        description="Example: fastllm evaluate pretrained.path=MODEL_DIR "
        "evaluators.mc.tasks=[hellaswag,arc_easy] evaluators.mc.num_fewshot=0; a training "
        "config may be given with -c (its pretrained section names the model, its "
        "model.distributed and model.multi_stage keys split it over torchrun's ranks as in "
        "training, its other sections are ignored). Results go to evaluation.json in the "
        "model's directory (or output=FILE) and are printed as lm-eval's tables.",
    )

    schedule = _config_command(
        commands,
        "schedule",
        _schedule,
        help="predict a config's pipeline step under breadth- and depth-first schedules",
        description="Times the step the runner would execute under a cost model (stage times "
        "from the FLOPs at --tflops, transfers and collectives at the given bandwidths) and "
        "prints the bubble, the exposed communication and the step time of each schedule.",
    )
    schedule.add_argument("--world-size", type=_positive_int, required=True, help="ranks")
    schedule.add_argument(
        "--tflops",
        type=_rate,
        default=EFFECTIVE_TFLOPS,
        help="compute per GPU (default: an H200's)",
    )
    schedule.add_argument(
        "--pipeline-gbps",
        type=_rate,
        default=LINK_GBPS,
        help="GB/s between pipeline ranks",
    )
    schedule.add_argument(
        "--data-gbps",
        type=_rate,
        default=LINK_GBPS,
        help="bus GB/s of data-parallel collectives",
    )
    schedule.add_argument("--png", type=Path, default=None, help="draw the timelines here")

    generate = commands.add_parser("generate", help="complete a prompt with a trained model")
    generate.add_argument("path", help="model directory (fastllm or Hugging Face format)")
    generate.add_argument("--prompt", required=True, help="text to complete")
    generate.add_argument(
        "--max-new-tokens", type=_positive_int, default=64, help="tokens to generate"
    )
    generate.add_argument(
        "--temperature",
        type=_non_negative_float,
        default=0.0,
        help="sampling temperature (0: greedy)",
    )
    generate.add_argument("--device", default=None, help="torch device (default: cuda if present)")
    generate.add_argument(
        "--chat",
        action="store_true",
        help="answer the prompt as a user turn, rendered with the model's chat template",
    )
    generate.add_argument("--system", default=None, help="with --chat: a system turn first")
    generate.add_argument(
        "--adapter", default=None, help="a PEFT LoRA adapter directory to run with the model"
    )
    generate.set_defaults(handler=_generate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    # Overrides may come before or after the options: collect the strays as overrides.
    args, strays = parser.parse_known_args(argv)
    if strays and (not hasattr(args, "arguments") or any(s.startswith("-") for s in strays)):
        parser.error(f"unrecognized arguments: {' '.join(strays)}")
    if strays:
        args.arguments += strays
    try:
        return args.handler(args) or EXIT_FINISHED
    except ConfigError as error:
        return _fail(str(error), EXIT_INPUT)
    except MachineError as error:
        return _fail(str(error), EXIT_MACHINE)
    except OSError as error:  # a system call failed: disk full, read-only, I/O error, …
        where = f"{error.filename}: " if error.filename else ""
        return _fail(f"{where}{error.strerror or error}", EXIT_MACHINE)
    except MemoryError:
        return _fail("out of memory", EXIT_MACHINE)
    except KeyboardInterrupt:  # Ctrl-C outside training's own handling
        print("fastllm: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    except Exception as error:
        if not _device_failure(error):
            raise
        return _fail(" ".join(str(error).split())[:500], EXIT_MACHINE)


def _fail(message: str, code: int) -> int:
    print(f"fastllm: error: {message}", file=sys.stderr)
    return code


def _device_failure(error: Exception) -> bool:
    """An accelerator out of memory or failing (torch's own errors; torch is never imported
    here, only looked up if a command imported it)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(error, torch.OutOfMemoryError | torch.AcceleratorError)


if __name__ == "__main__":
    sys.exit(main())
