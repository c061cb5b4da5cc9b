rule wikitext:
    output:
        "resources/data/wiki.test.raw",
    params:
        source=config["text"],
    log:
        "logs/wikitext.log",
    benchmark:
        "benchmarks/wikitext.tsv"
    run:
        copy_wikitext(params.source, output[0], log[0])
