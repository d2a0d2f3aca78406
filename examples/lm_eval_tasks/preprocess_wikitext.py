"""wikitext_local.yaml's functions: lm-evaluation-harness's own wikitext detokenizer and counts."""

from lm_eval.tasks.wikitext.preprocess_wikitext import process_results, wikitext_detokenizer  # noqa: F401
