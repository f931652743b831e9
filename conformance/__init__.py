"""glmcore's conformance suite and benchmark: every backend held to the torch reference's logits.

    glmcore conformance [--backend B] [--model DIR]     # see conformance/README.md
    glmcore bench --backend B --size small [--vs torch]
"""
from .report import CaseResult, Report, format_table, to_markdown
from .suite import SuiteOptions, run_suite
from .tolerances import TOLERANCES, Tolerance, tolerance_key

__all__ = ["run_suite", "SuiteOptions", "Report", "CaseResult", "format_table", "to_markdown", "TOLERANCES", "Tolerance",
           "tolerance_key"]
