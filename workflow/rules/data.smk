rule wikitext:
    output:
        "resources/data/wiki.test.raw",
    params:
        source=config["text"],
    log:
        "logs/wikitext.log",
    benchmark:
        "benchmarks/wikitext.tsv"
    conda:
        "../../envs/kvarn.yaml"
    script:
        "../scripts/fetch_text.py"
