"""The per-pass parts an export ships beside the built-in ones of parts_lol.py: none here.

The exporter rewrites this file for a model whose plan uses parts defined outside megatron_lol
(megatron_lol/convert/part_sources.py): it then imports each shipped part's module and registers
the part, so that the exported steps' part names resolve.
"""

SHIPPED = ()
