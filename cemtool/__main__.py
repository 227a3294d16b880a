from cemtool.cli.main import main

main()
