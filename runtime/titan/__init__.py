# torchtitan as a second runtime (issue 60): its model, dataloader, metrics and entry point over our data.
