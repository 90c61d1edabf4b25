"""The ``prune.py`` command line (jsonargparse, the same YAML conventions as ``train.py``).

Subcommands:

- ``vision``: prune a trained vision checkpoint with one method, retraining between steps;
- ``magnitude``, ``wanda``, ``sparsegpt``, ``debias-sparsegpt``: post-training pruning of a causal LM
  (unstructured or N:M), written as a transformers folder with its report;
- ``fasp``: fairness-aware attention-head pruning (and its baselines) of a causal LM;
- ``diff-compare``: full fine-tuning, fine-tuning + pruned difference and Diff-Pruning, one table;
- ``evaluate``: perplexity, paired stereotype score and sparsity of a causal LM;
- ``compare``: several methods × sparsities from one vision checkpoint (``--ckpt``) or one causal
  LM (``--model``), one table (and plots for vision).

Every subcommand takes ``--config file.yaml`` (keys = the option names) and command-line
overrides; ``--print_config`` shows the resolved configuration.
"""

from __future__ import annotations

from typing import Any

from jsonargparse import ActionConfigFile, ArgumentParser

from fairprune.callbacks.pruning import IterativePruning
from fairprune.cli.train import guarded
from fairprune.errors import UserError


LLM_METHODS = ("magnitude", "wanda", "sparsegpt", "debias-sparsegpt")


def _lm_args(parser: ArgumentParser) -> None:
    parser.add_argument("--calib_text", type=str | None, default=None, help="calibration text file/folder (default: bundled corpus)")
    parser.add_argument("--eval_text", type=str | None, default=None, help="perplexity text, e.g. WikiText-2 raw test (default: bundled)")
    parser.add_argument("--pairs", type=str | None, default=None, help="StereoSet JSON or CrowS-Pairs CSV (default: bundled pairs)")
    parser.add_argument("--nsamples", type=int, default=128, help="calibration windows")
    parser.add_argument("--seqlen", type=int, default=128, help="calibration window length")
    parser.add_argument("--eval_seqlen", type=int | None, default=None, help="perplexity window (default: --seqlen)")
    parser.add_argument("--device", type=str, default="auto", help="auto, cpu, cuda, cuda:1 ...")
    parser.add_argument("--percdamp", type=float, default=0.01, help="SparseGPT damping, fraction of mean diag(H)")
    parser.add_argument("--blocksize", type=int, default=128, help="SparseGPT column block")
    parser.add_argument("--trust_remote_code", type=bool, default=False, help="allow a hub model's own code to run")


def _lm_settings(sub) -> dict[str, Any]:
    keys = ("nsamples", "seqlen", "eval_seqlen", "device", "percdamp", "blocksize")
    return {k: sub[k] for k in keys}


def _common(parser: ArgumentParser, ckpt_required: bool = True) -> None:
    parser.add_argument("--config", action=ActionConfigFile, help="YAML file with any of these options")
    parser.add_argument("--ckpt", type=str | None, default=None, required=ckpt_required, help="dense checkpoint written by train.py")
    parser.add_argument("--output", type=str, default="runs/prune", help="folder the run folder(s) go in")
    parser.add_argument("--trainer", type=dict[str, Any], default={}, help="Trainer arguments (accelerator, limit_train_batches, ...)")
    parser.add_argument("--data", type=dict[str, Any], default={}, help="data module overrides (root, batch_size, num_workers, ...)")
    parser.add_argument("--seed", type=int, default=0)


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="prune.py", description="Prune trained models and measure what it costs each group.",
                            exit_on_error=False)
    commands = parser.add_subcommands(dest="command")

    vision = ArgumentParser(description="Prune a trained vision checkpoint (FairGRAPE, magnitude, SNIP, GraSP, random, lottery).",
                            exit_on_error=False)
    _common(vision)
    vision.add_class_arguments(IterativePruning, "pruning", help="pruning method and schedule")
    vision.add_argument("--name", type=str | None, default=None, help="run folder name (default: the method)")
    vision.add_argument("--resume", type=str | None, default=None, help="checkpoint of an interrupted pruning run to resume")
    commands.add_subcommand("vision", vision)

    for method in LLM_METHODS:
        sub = ArgumentParser(description=f"Post-training {method} pruning of a causal LM; writes an HF folder.",
                             exit_on_error=False)
        sub.add_argument("--config", action=ActionConfigFile)
        sub.add_argument("--model", type=str, required=True, help="hub name or folder (e.g. runs/lm/tiny_gpt2/model)")
        sub.add_argument("--sparsity", type=str, default="0.5", help="fraction in [0, 1) or N:M such as 2:4")
        sub.add_argument("--nm", type=str | None, default=None, help="N:M pattern (same as --sparsity 2:4)")
        sub.add_argument("--output", type=str, required=True, help="folder for the pruned model and report.json")
        sub.add_argument("--seed", type=int, default=0)
        _lm_args(sub)
        commands.add_subcommand(method, sub)

    fasp = ArgumentParser(description="FASP: remove the attention heads that most raise toxicity disparity, "
                                      "protecting the heads perplexity needs.", exit_on_error=False)
    fasp.add_argument("--config", action=ActionConfigFile)
    fasp.add_argument("--model", type=str, required=True, help="hub name or folder of a causal LM")
    fasp.add_argument("--method", type=str, default="fasp", help="fasp, fairness, performance, magnitude, gradient, random")
    fasp.add_argument("--gamma", type=float | None, default=0.3, help="share of heads protected for perplexity; null = search on validation prompts")
    fasp.add_argument("--alpha", type=float, default=0.1, help="share of all heads to remove")
    fasp.add_argument("--axis", type=str, default="gender_and_sex", help="bias axis, or 'all'")
    fasp.add_argument("--scorer", type=str, default="lexicon", help="'lexicon' (bundled) or an HF toxicity classifier name/folder")
    fasp.add_argument("--prompts", type=str | None, default=None, help="HolisticBias-format CSV (text,axis,bucket,descriptor); default bundled")
    fasp.add_argument("--ppl_text", type=str | None, default=None, help="text for head scoring perplexity (default: bundled)")
    fasp.add_argument("--eval_text", type=str | None, default=None, help="text for the reported perplexity (default: --ppl_text)")
    fasp.add_argument("--max_new_tokens", type=int, default=20)
    fasp.add_argument("--seqlen", type=int, default=128)
    fasp.add_argument("--output", type=str, required=True, help="folder: pruned model, head_scores.csv, report.json, plots")
    fasp.add_argument("--trust_remote_code", type=bool, default=False)
    fasp.add_argument("--seed", type=int, default=0)
    commands.add_subcommand("fasp", fasp)

    diff = ArgumentParser(description="Full fine-tuning vs fine-tuning + magnitude-pruned difference vs Diff-Pruning, "
                                      "one table, from a train.py text config.", exit_on_error=False)
    diff.add_argument("--config", action=ActionConfigFile)
    diff.add_argument("--train_config", type=str, required=True, help="a train.py config (model + data), e.g. configs/text/diffprune_bios.yaml")
    diff.add_argument("--overrides", type=list[str], default=[], help="extra train.py arguments, e.g. ['--data.bios_size', '400']")
    diff.add_argument("--target_fraction", type=float, default=0.005, help="share of weights the difference may change")
    diff.add_argument("--epochs", type=int, default=3, help="epochs of full fine-tuning and of gated training")
    diff.add_argument("--finetune_epochs", type=int, default=1, help="epochs of fixed-mask fine-tuning")
    diff.add_argument("--trainer", type=dict[str, Any], default={}, help="Trainer arguments (accelerator, limit_train_batches, ...)")
    diff.add_argument("--output", type=str, default="runs/diff_compare")
    commands.add_subcommand("diff-compare", diff)

    evaluate = ArgumentParser(description="Perplexity, stereotype score and sparsity of a causal LM.", exit_on_error=False)
    evaluate.add_argument("--config", action=ActionConfigFile)
    evaluate.add_argument("--model", type=str, required=True)
    evaluate.add_argument("--output", type=str | None, default=None, help="folder for report.json")
    evaluate.add_argument("--eval_text", type=str | None, default=None)
    evaluate.add_argument("--pairs", type=str | None, default=None)
    evaluate.add_argument("--seqlen", type=int, default=128)
    evaluate.add_argument("--device", type=str, default="auto")
    evaluate.add_argument("--trust_remote_code", type=bool, default=False)
    evaluate.add_argument("--seed", type=int, default=0)
    commands.add_subcommand("evaluate", evaluate)

    compare = ArgumentParser(description="Compare methods x sparsities: a vision checkpoint (--ckpt) or a causal LM (--model).",
                             exit_on_error=False)
    _common(compare, ckpt_required=False)
    compare.add_argument("--model", type=str | None, default=None, help="causal LM (name or folder) instead of --ckpt")
    compare.add_argument("--methods", type=list[str], default=["magnitude", "fairgrape"])
    compare.add_argument("--sparsities", type=list[str | float], default=[0.9], help="vision: fractions; LM: fractions or N:M")
    compare.add_argument("--pruning", type=dict[str, Any], default={}, help="vision: settings shared by every method (keep_per_iter, ...)")
    compare.add_argument("--alphas", type=list[float] | None, default=None,
                         help="head pruning (FASP and baselines) at these α instead of weight sparsities")
    compare.add_argument("--gamma", type=float | None, default=0.3, help="FASP's protected share (with --alphas)")
    compare.add_argument("--axis", type=str, default="gender_and_sex", help="bias axis or 'all' (with --alphas)")
    compare.add_argument("--scorer", type=str, default="lexicon", help="toxicity scorer (with --alphas)")
    compare.add_argument("--prompts", type=str | None, default=None, help="HolisticBias-format CSV (with --alphas)")
    compare.add_argument("--max_new_tokens", type=int, default=20, help="continuation length (with --alphas)")
    _lm_args(compare)
    commands.add_subcommand("compare", compare)
    return parser


def run(args: list[str] | None = None) -> Any:
    cfg = build_parser().parse_args(args)
    sub = cfg[cfg.command]
    if cfg.command == "vision":
        from fairprune.workflows.vision import prune_vision

        report = prune_vision(sub.ckpt, dict(sub.pruning), sub.output, sub.name, dict(sub.trainer), dict(sub.data),
                              sub.resume, sub.seed)
        print(f"[prune] {report['method']}: accuracy {report['metrics'].get('accuracy', float('nan')):.4f}, "
              f"sparsity {report['achieved_sparsity']:.4f}")
        return report
    if cfg.command in LLM_METHODS:
        from fairprune.workflows.lm import run_llm_pruning

        return run_llm_pruning(sub.model, cfg.command, sub.nm or sub.sparsity, sub.output, calib_text=sub.calib_text,
                               eval_text=sub.eval_text, pairs=sub.pairs, trust_remote_code=sub.trust_remote_code,
                               seed=sub.seed, **_lm_settings(sub))
    if cfg.command == "fasp":
        from fairprune.workflows.heads import run_fasp_cli

        return run_fasp_cli(sub)
    if cfg.command == "diff-compare":
        return diff_compare(sub)
    if cfg.command == "evaluate":
        from fairprune.workflows.lm import evaluate_lm

        return evaluate_lm(sub.model, sub.output, eval_text=sub.eval_text, pairs=sub.pairs, seqlen=sub.seqlen,
                           device=sub.device, trust_remote_code=sub.trust_remote_code, seed=sub.seed)
    if cfg.command == "compare":
        from fairprune.reporting.report import markdown

        if (sub.ckpt is None) == (sub.model is None):
            raise UserError("compare needs exactly one of --ckpt (a vision checkpoint) or --model (a causal LM)")
        if sub.model is not None and sub.alphas:
            from fairprune.workflows.heads import compare_fasp

            table = compare_fasp(sub.model, sub.methods, sub.alphas, sub.output, gamma=sub.gamma, axis=sub.axis,
                                 scorer=sub.scorer, prompts=sub.prompts, ppl_text=sub.eval_text,
                                 max_new_tokens=sub.max_new_tokens, seqlen=sub.seqlen,
                                 trust_remote_code=sub.trust_remote_code, seed=sub.seed)
        elif sub.model is not None:
            from fairprune.workflows.lm import compare_lm

            table = compare_lm(sub.model, sub.methods, sub.sparsities, sub.output, calib_text=sub.calib_text,
                               eval_text=sub.eval_text, pairs=sub.pairs, trust_remote_code=sub.trust_remote_code,
                               seed=sub.seed, **_lm_settings(sub))
        else:
            from fairprune.workflows.vision import compare_vision

            table = compare_vision(sub.ckpt, sub.methods, [float(s) for s in sub.sparsities], dict(sub.pruning),
                                   sub.output, dict(sub.trainer), dict(sub.data), sub.seed)
        print("\n" + markdown(table.set_index("method")) + "\n")
        print(f"[compare] written to {sub.output}/comparison.csv, comparison.md and plots")
        return table
    raise AssertionError(cfg.command)


def diff_compare(sub) -> Any:
    """Build the model and data of a train.py config (without running it) and compare the three
    ways of fine-tuning them; writes comparison.csv / .md and report.json to ``--output``."""
    from pathlib import Path

    from fairprune.workflows.diff import compare_diff_pruning
    from fairprune.cli.train import FairpruneCLI
    from fairprune.reporting.report import markdown, write_json

    import warnings

    warnings.filterwarnings("ignore", message="LightningCLI's args parameter")  # prune.py's own argv is not train.py's
    cli = FairpruneCLI(model_class=None, datamodule_class=None, subclass_mode_model=True, subclass_mode_data=True,
                       run=False, save_config_callback=None, parser_kwargs={"exit_on_error": False},
                       args=["--config", sub.train_config, *sub.overrides])
    out = Path(sub.output)
    table = compare_diff_pruning(cli.model, cli.datamodule, sub.target_fraction, sub.epochs, sub.finetune_epochs,
                                 out, dict(sub.trainer))
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / "comparison.csv", index_label="method")
    (out / "comparison.md").write_text(markdown(table) + "\n")
    write_json(out / "report.json", {"comparison": table.reset_index(names="method").to_dict(orient="records"),
                                     "target_fraction": sub.target_fraction})
    print("\n" + markdown(table) + "\n")
    print(f"[diff-compare] written to {out}/comparison.csv and comparison.md")
    return table


def main(args: list[str] | None = None) -> int:
    return guarded(lambda: run(args))
