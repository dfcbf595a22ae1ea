from v4flash_pd.cli.main import main

main()
